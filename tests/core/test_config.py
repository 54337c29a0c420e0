"""config/config.json -> GPTConfig: the course file, overrides, and errors that name the key and file."""

import json
from dataclasses import fields
from pathlib import Path

import pytest

from course_lib.core.config import JSON_TO_FIELD, config_from_dict, config_to_json_dict, load_model_config
from course_lib.core.model import PRESETS, GPTConfig

COURSE_CONFIG = Path(__file__).resolve().parents[2] / "config" / "config.json"


def _write(tmp_path, values, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(values))
    return path


def test_course_config_is_the_tiny_model_with_two_layers():
    raw = json.loads(COURSE_CONFIG.read_text())
    assert raw["num_hidden_layers"] == 2  # Lab 1 asks learners to change this to 4
    assert load_model_config(COURSE_CONFIG) == PRESETS["tiny"]


def test_overrides_by_json_key_or_field_name():
    assert load_model_config(COURSE_CONFIG, num_hidden_layers=4).n_layer == 4
    assert load_model_config(COURSE_CONFIG, n_layer=3).n_layer == 3
    assert load_model_config(COURSE_CONFIG, hidden_dropout=0.1).dropout == 0.1


def test_every_gptconfig_field_has_a_json_key():
    assert {f.name for f in fields(GPTConfig)} == set(JSON_TO_FIELD.values())
    config = GPTConfig.from_preset("small", dropout=0.1, attn_impl="explicit")
    assert config_from_dict(config_to_json_dict(config)) == config


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    path = _write(tmp_path, {"num_hidden_layer": 4})
    with pytest.raises(ValueError) as err:
        load_model_config(path)
    message = str(err.value)
    assert "'num_hidden_layer'" in message and str(path) in message
    assert "Did you mean 'num_hidden_layers'?" in message
    assert "max_position_embeddings" in message  # the list of valid keys
    with pytest.raises(ValueError, match="unknown key 'n_layers'.*Did you mean 'num_hidden_layers'"):
        load_model_config(COURSE_CONFIG, n_layers=4)


@pytest.mark.parametrize("key,value,pattern", [
    ("hidden_size", "64", r"'hidden_size' must be an integer, got '64'"),
    ("num_hidden_layers", True, r"'num_hidden_layers' must be an integer"),
    ("rms_norm_eps", "small", r"'rms_norm_eps' must be a number"),
    ("num_hidden_layers", 0, r"'num_hidden_layers' \(GPTConfig.n_layer\) must be a positive integer, got 0"),
    ("num_attention_heads", 3, r"divisible by 'num_attention_heads'"),
    ("dropout", 1.5, r"'dropout' \(GPTConfig.dropout\) must be in \[0, 1\)"),
    ("attn_implementation", "flash", r"'attn_implementation' \(GPTConfig.attn_impl\) must be one of"),
])
def test_bad_values_name_key_and_file(tmp_path, key, value, pattern):
    values = json.loads(COURSE_CONFIG.read_text())
    values[key] = value
    path = _write(tmp_path, values)
    with pytest.raises(ValueError, match=pattern) as err:
        load_model_config(path)
    assert str(path) in str(err.value)


def test_file_problems(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        load_model_config(tmp_path / "nowhere.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"hidden_size": 64,\n "num_hidden_layers": }')
    with pytest.raises(ValueError, match=r"broken.json is not valid JSON.*line 2"):
        load_model_config(broken)
    listed = _write(tmp_path, [1, 2], "list.json")
    with pytest.raises(ValueError, match="JSON object"):
        load_model_config(listed)


def test_comment_keys_are_ignored(tmp_path):
    path = _write(tmp_path, {"_comment": "anything", "num_hidden_layers": 3})
    assert load_model_config(path).n_layer == 3
