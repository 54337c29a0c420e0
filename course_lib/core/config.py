"""Model config files: config/config.json, in the key names of Hugging Face configs, to a GPTConfig.

    JSON key                  GPTConfig field
    vocab_size                vocab_size
    hidden_size               n_embd
    num_hidden_layers         n_layer
    num_attention_heads       n_head
    intermediate_size         ffn_hidden   (null: about 8/3 * hidden_size)
    max_position_embeddings   block_size
    rms_norm_eps              norm_eps
    rope_theta                rope_theta
    dropout / hidden_dropout  dropout
    attn_implementation       attn_impl    ("sdpa" or "explicit")
    gradient_checkpointing    activation_checkpointing

Keys starting with "_" are comments and ignored. Any other unknown key, or a value of the wrong type,
is an error that names the key and the file (with a did-you-mean suggestion for misspelt keys).
add_dataclass_arguments() turns a config dataclass (such as course_lib.train.TrainConfig) into CLI flags.

    python -m course_lib.core.config                         # prints the GPTConfig of config/config.json
    python -m course_lib.core.config --config my.json num_hidden_layers=4
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import json
import re
import textwrap
import typing
from dataclasses import fields
from pathlib import Path

from course_lib.core.model import GPT, GPTConfig

DEFAULT_CONFIG = "config/config.json"

JSON_TO_FIELD = {
    "vocab_size": "vocab_size",
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "intermediate_size": "ffn_hidden",
    "max_position_embeddings": "block_size",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "dropout": "dropout",
    "hidden_dropout": "dropout",
    "attn_implementation": "attn_impl",
    "gradient_checkpointing": "activation_checkpointing",
}
FIELD_TO_JSON = {field: key for key, field in reversed(list(JSON_TO_FIELD.items()))}  # dropout -> "dropout"
_TYPES = {"vocab_size": int, "n_embd": int, "n_layer": int, "n_head": int, "ffn_hidden": int, "block_size": int,
          "norm_eps": float, "rope_theta": float, "dropout": float, "attn_impl": str, "activation_checkpointing": bool}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _field_of(key: str) -> str | None:
    return JSON_TO_FIELD.get(key) or (key if key in FIELD_TO_JSON else None)


def _check_type(key: str, field: str, value, where: str) -> None:
    expected = _TYPES[field]
    if value is None and field == "ffn_hidden":
        return
    ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
    if expected is float:  # JSON writes 1e-05 as a float but 10000 as an integer; both are numbers
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{where}: {key!r} must be {_TYPE_NAMES[expected]}, got {value!r} ({type(value).__name__})")


def _unknown_key_error(key: str, where: str) -> ValueError:
    valid = sorted(JSON_TO_FIELD)
    close = difflib.get_close_matches(key, valid + list(FIELD_TO_JSON), n=1, cutoff=0.6)
    hint = ""
    if close:
        suggestion = close[0] if close[0] in JSON_TO_FIELD else FIELD_TO_JSON[close[0]]
        hint = f" Did you mean {suggestion!r}?"
    return ValueError(f"{where}: unknown key {key!r}.{hint} Valid keys: {', '.join(valid)} "
                      "(keys starting with '_' are comments)")


def _with_json_names(message: str) -> str:
    """Rewrite GPTConfig's 'GPTConfig.n_layer' as 'num_hidden_layers (GPTConfig.n_layer)'."""
    return re.sub(r"GPTConfig\.(\w+)",
                  lambda m: f"{FIELD_TO_JSON.get(m.group(1), m.group(1))!r} (GPTConfig.{m.group(1)})", message)


def config_from_dict(values: dict, where: str = "model config") -> GPTConfig:
    """A GPTConfig from JSON-style keys (GPTConfig field names are accepted too). Errors start with `where`."""
    kwargs = {}
    for key, value in values.items():
        if key.startswith("_"):
            continue
        field = _field_of(key)
        if field is None:
            raise _unknown_key_error(key, where)
        _check_type(key, field, value, where)
        if field in kwargs:
            raise ValueError(f"{where}: {key!r} sets GPTConfig.{field}, which another key already set")
        kwargs[field] = float(value) if _TYPES[field] is float else value
    try:
        return GPTConfig(**kwargs)
    except ValueError as err:
        raise ValueError(f"{where}: {_with_json_names(str(err))}") from err


def load_model_config(path=DEFAULT_CONFIG, **overrides) -> GPTConfig:
    """Read a JSON model config file; keyword overrides (JSON keys or GPTConfig names) win over the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model config file {path} not found (the course's is {DEFAULT_CONFIG}, "
                                "relative to the repository root)")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from err
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object {{\"key\": value, ...}}, got {type(values).__name__}")
    for key, value in overrides.items():
        field = _field_of(key)
        if field is None:
            raise _unknown_key_error(key, f"override for {path}")
        values = {k: v for k, v in values.items() if _field_of(k) != field}  # the override replaces them
        values[key] = value
    return config_from_dict(values, where=str(path))


def config_to_json_dict(config: GPTConfig) -> dict:
    """The inverse of config_from_dict: a GPTConfig as JSON keys, ready for json.dump."""
    return {FIELD_TO_JSON.get(f.name, f.name): getattr(config, f.name) for f in fields(config)}


def _field_docs(cls) -> dict[str, str]:
    """The docstring under each dataclass field (Python keeps them only in the source)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):
        return {}
    return {node.target.id: " ".join(doc.value.value.split()) for node, doc in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)}


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, special: dict | None = None) -> None:
    """Add one --field flag per dataclass field, typed from its annotation and helped by its docstring.

    bool fields become --x / --no-x; `X | None` fields also accept the word none. `special` maps a field
    name to add_argument keyword arguments that replace the generated ones.
    """
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    for f in fields(cls):
        kwargs = {"default": f.default, "help": docs.get(f.name, "").replace("%", "%%")}
        options = typing.get_args(hints[f.name])
        base = next((t for t in options if t is not type(None)), hints[f.name])
        if f.name in (special or {}):
            kwargs.update(special[f.name])
        elif base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            def convert(text, base=base, optional=type(None) in options):
                return None if optional and text.lower() == "none" else base(text)
            convert.__name__ = base.__name__  # argparse names the type in its error messages
            kwargs["type"] = convert
        parser.add_argument(f"--{f.name}", **kwargs)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Print the GPTConfig that a JSON model config file describes.")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("overrides", nargs="*", help="key=value pairs, value in JSON (num_hidden_layers=4)")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"override {item!r} must look like key=value")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value  # a bare string such as attn_implementation=explicit
    config = load_model_config(args.config, **overrides)
    print(config)
    print(f"{GPT(config).num_params():,} parameters")


if __name__ == "__main__":
    main()
