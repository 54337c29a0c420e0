"""Byte-level BPE, token files of any vocabulary size, the shard command, and training on BPE ids."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib import train as train_cli
from course_lib.core.data import RandomBatches, load_tokens
from course_lib.core.metrics import read_metrics
from course_lib.core.tokenizer import (BPETokenizer, END_OF_TEXT, course_corpus_path, load_tokenizer,
                                       shard_text_files, token_dtype, train_bpe)

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = {
    "a.txt": "The cat sat on the mat.\n\nThe dog sat on the log.\n\nA cat and a dog met on the mat.\n" * 20,
    "notes/b.txt": "Naïve café owners serve crème brûlée — 😀 — every day.\n\nThe owners sat down.\n" * 15,
    "notes/skip.md": "not a .txt file: left out by the default pattern\n",
}


@pytest.fixture
def user_texts(tmp_path):
    """A user's folder of text files, with each file's bytes and modification time to check afterwards."""
    folder = tmp_path / "my_texts"
    for name, text in TEXTS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()} | {"folders": sorted(map(str, folder.rglob("*")))}


def test_token_dtype_is_the_smallest_that_holds_every_id():
    assert [token_dtype(v).name for v in (2, 256, 257, 65536, 65537, 200_000)] == \
        ["uint8", "uint8", "uint16", "uint16", "uint32", "uint32"]
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


def test_bpe_round_trips_any_text_merges_frequent_words_and_trains_deterministically():
    texts = [TEXTS["a.txt"], TEXTS["notes/b.txt"]]
    tok = train_bpe(texts, vocab_size=300)
    assert tok.vocab_size == 300 and tok.eot_id == tok.tokenizer.token_to_id(END_OF_TEXT)
    for text in ["The cat sat.", "Naïve crème brûlée 😀", "never seen: Ωμέγα ∑ 漢字\n\n  spaces  "]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(" the mat")) < len(" the mat".encode())  # merges learned from the texts
    assert train_bpe(texts, vocab_size=300).tokenizer.to_str() == tok.tokenizer.to_str()
    with pytest.raises(ValueError, match="at least 258"):
        train_bpe(texts, vocab_size=257)
    with pytest.raises(ValueError, match=r"0\.\.299"):
        tok.decode([300])


def test_shards_equal_the_whole_files_encoded_joined_by_end_of_text_and_the_user_files_are_untouched(
        user_texts, tmp_path):
    before = snapshot(user_texts)
    out = tmp_path / "shards"
    meta = shard_text_files([user_texts], out, vocab_size=300, val_fraction=0.2, log=lambda *_: None)
    assert snapshot(user_texts) == before  # read, never written: same files, bytes and modification times
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert json.loads((out / "meta.json").read_text()) == meta
    assert (meta["dtype"], meta["vocab_size"], meta["files"]) == ("uint16", 300, 2)
    tok = load_tokenizer(out)
    assert isinstance(tok, BPETokenizer) and tok.eot_id == meta["eot_id"]
    train, val = load_tokens("train", out), load_tokens("val", out)
    assert train.dtype == torch.int32 and (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    expected = []
    for name in ("a.txt", "notes/b.txt"):  # sorted paths; the .md file is not *.txt
        expected += tok.encode(TEXTS[name]) + [tok.eot_id]
    assert torch.cat([train, val]).tolist() == expected
    assert abs(len(val) / len(expected) - 0.2) < 0.05
    assert tok.decode(val[:3]).startswith("\n\n")  # the split falls where a paragraph starts
    batch = next(RandomBatches(train, batch_size=2, block_size=16, seed=0))
    assert batch.dtype == torch.long and batch.shape == (2, 16)


def test_the_shard_command_refuses_to_write_among_the_texts_or_over_other_files_and_replaces_only_with_force(
        user_texts, tmp_path):
    quiet = {"vocab_size": 300, "log": lambda *_: None}
    with pytest.raises(ValueError, match="inside the input folder"):
        shard_text_files([user_texts], user_texts / "shards", **quiet)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "train.bin").write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="not token files written by this command"):
        shard_text_files([user_texts], theirs, **quiet)
    assert (theirs / "train.bin").read_bytes() == b"precious"
    out = tmp_path / "shards"
    first = shard_text_files([user_texts / "a.txt"], out, **quiet)
    with pytest.raises(FileExistsError, match="--force"):
        shard_text_files([user_texts], out, **quiet)
    assert json.loads((out / "meta.json").read_text()) == first
    again = shard_text_files([user_texts], out, force=True, **quiet)
    assert again["files"] == 2 and json.loads((out / "meta.json").read_text()) == again
    reused = shard_text_files([user_texts], tmp_path / "reused", tokenizer=out / "tokenizer.json", **quiet)
    assert (tmp_path / "reused" / "train.bin").read_bytes() == (out / "train.bin").read_bytes()
    assert reused["source_sha256"] == again["source_sha256"]
    (user_texts / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8"):
        shard_text_files([user_texts], tmp_path / "new", **quiet)
    with pytest.raises(FileNotFoundError, match="missing"):
        shard_text_files([tmp_path / "missing"], tmp_path / "new", **quiet)


def test_load_tokens_reads_uint32_ids_and_names_a_file_that_does_not_match_its_dtype(tmp_path):
    ids = np.array([0, 70_000, 65_535, 65_536, 123_456], dtype=np.uint32)
    for split in ("train", "val"):
        ids.tofile(tmp_path / f"{split}.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 123_457}))
    loaded = load_tokens("train", tmp_path)
    assert loaded.dtype == torch.int64 and loaded.tolist() == ids.tolist()
    (tmp_path / "val.bin").write_bytes(ids.tobytes()[:-1])
    with pytest.raises(ValueError, match=r"val\.bin holds 19 bytes, not a whole number of uint32"):
        load_tokens("val", tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "float32"}))
    with pytest.raises(ValueError, match="dtype 'float32'"):
        load_tokens("train", tmp_path)


def test_a_bpe_tokenized_course_corpus_trains_through_the_cli_and_its_loss_falls(tmp_path, capsys):
    """The tokenizer is trained on the course corpus, the shards written, then 20 steps of python -m
    course_lib.train (its main(), in this process) on them: the model gets the tokenizer's vocabulary."""
    data = tmp_path / "bpe"
    meta = shard_text_files([course_corpus_path()], data, vocab_size=512, log=lambda *_: None)
    assert meta["dtype"] == "uint16" and meta["bytes_per_token"] > 1.8  # real merges: fewer tokens than bytes
    out = tmp_path / "run"
    train_cli.main(["--data_dir", str(data), "--max_steps", "20", "--out_dir", str(out), "--no-progress",
                             "--eval_interval", "0", "--no-tensorboard", "--batch_size", "8", "--warmup_steps", "2"])
    assert "vocab_size 512 for the 512 token ids" in capsys.readouterr().out
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "train"]
    assert len(losses) == 20
    assert np.log(512) - 0.3 < losses[0] < np.log(512) + 0.3  # an untrained model: about ln(vocab)
    assert max(losses[-3:]) < losses[0] - 0.5
    saved = torch.load(out / "latest.pt", weights_only=True)
    assert saved["model_config"]["vocab_size"] == 512


def test_the_shard_script_leaves_the_texts_untouched_and_says_what_is_wrong_in_one_line(user_texts, tmp_path):
    before = snapshot(user_texts)
    script = [sys.executable, str(REPO_ROOT / "scripts" / "text_to_shards.py")]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(script + [str(user_texts), "--out", str(tmp_path / "out"), "--vocab-size", "300"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--data_dir" in done.stdout and (tmp_path / "out" / "meta.json").exists()
    assert snapshot(user_texts) == before
    bad = subprocess.run(script + [str(user_texts), "--out", str(user_texts / "x")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("scripts/text_to_shards.py: error: --out")
    assert snapshot(user_texts) == before
