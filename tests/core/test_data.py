"""Tests for course_lib.core.data: corpus, byte tokenizer, token files, batch samplers, synthetic data."""

import collections
import io
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from course_lib.core import data
from course_lib.core.data import (
    ByteTokenizer,
    RandomBatches,
    eval_batches,
    load_corpus,
    load_tokens,
    prepare_tokens,
    synthetic_tokens,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    return data_dir, prepare_tokens(data_dir, progress=False)


# --- tokenizer -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "hello world\n", "Fußball — naïve café", "日本語 🙂 tabs\tand\r\nlines"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text


def test_tokenizer_non_ascii_takes_several_bytes_and_cut_characters_decode_to_replacement():
    tok = ByteTokenizer()
    ids = tok.encode("ß🙂")
    assert len(ids) == 2 + 4
    assert tok.decode(ids[:-1]) == "ß\ufffd"  # a cut 4-byte character becomes U+FFFD, no exception


def test_tokenizer_rejects_ids_outside_the_byte_range():
    with pytest.raises(ValueError, match=r"0\.\.255.*300"):
        ByteTokenizer().decode([104, 300])


# --- corpus --------------------------------------------------------------------------------------

def test_shipped_corpus_is_large_english_prose():
    text = load_corpus()
    assert 1_000_000 <= len(text.encode("utf-8")) <= 1_600_000
    words = collections.Counter(w.lower() for w in text.split())
    assert "the" in [w for w, _ in words.most_common(5)]
    assert ">>>" not in text, "doctest examples are code and should have been removed"
    assert "\n\n\n" not in text


def test_corpus_stats_counts():
    stats = data.corpus_stats("ab cd é")
    assert stats == {"chars": 7, "words": 3, "bytes": 8, "unique_bytes": 7, "bytes_per_word": 8 / 3}
    full = data.corpus_stats()
    assert full["bytes"] == len(ByteTokenizer().encode(load_corpus()))
    assert full["unique_bytes"] <= 256 and full["bytes_per_word"] > 1


def test_corpus_readme_says_where_the_text_comes_from():
    readme = (REPO / "course_lib" / "corpus" / "README.md").read_text()
    assert "Python 3.11" in readme and "scripts/build_corpus.py" in readme and "License" in readme


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the shipped corpus is built from Python 3.11")
def test_build_script_reproduces_the_start_of_the_shipped_corpus():
    # The first 25 files keep this fast; `python scripts/build_corpus.py --check` compares all of it.
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_corpus
    finally:
        sys.path.remove(str(REPO / "scripts"))
    import sysconfig
    rebuilt = build_corpus.build_corpus(Path(sysconfig.get_paths()["stdlib"]), max_files=25)
    assert len(rebuilt) > 50_000
    assert load_corpus().startswith(rebuilt.rstrip("\n") + "\n\n")


# --- token files ---------------------------------------------------------------------------------

def test_prepare_tokens_files_decode_back_to_the_corpus(prepared):
    data_dir, paths = prepared
    train, val = paths["train"].read_bytes(), paths["val"].read_bytes()
    corpus = load_corpus()
    assert ByteTokenizer().decode(list(train + val)) == corpus
    assert abs(len(val) / (len(train) + len(val)) - 0.1) < 0.01
    assert train.endswith(b"\n\n"), "the split should fall on a docstring boundary"
    meta = json.loads((data_dir / "meta.json").read_text())
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert meta["vocab_size"] == 256 and len(meta["corpus_sha256"]) == 64
    assert not list(data_dir.glob("*.tmp*")), "temporary files must be renamed away"


def test_prepare_tokens_is_idempotent_and_force_rewrites(tmp_path):
    paths = prepare_tokens(tmp_path, progress=False)
    files = [*paths.values(), tmp_path / "meta.json"]
    for f in files:
        os.utime(f, ns=(0, 0))  # an old mtime: any rewrite changes it
    prepare_tokens(tmp_path, progress=False)
    assert [f.stat().st_mtime_ns for f in files] == [0, 0, 0]
    prepare_tokens(tmp_path, progress=False, force=True)
    assert all(f.stat().st_mtime_ns != 0 for f in files)


def test_prepare_tokens_rebuilds_stale_or_damaged_files(tmp_path):
    paths = prepare_tokens(tmp_path, progress=False)
    total = sum(p.stat().st_size for p in paths.values())
    prepare_tokens(tmp_path, val_fraction=0.2, progress=False)  # a different split is rebuilt
    assert abs(paths["val"].stat().st_size / total - 0.2) < 0.01
    paths["train"].write_bytes(b"truncated")
    prepare_tokens(tmp_path, val_fraction=0.2, progress=False)
    assert paths["train"].stat().st_size + paths["val"].stat().st_size == total
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["corpus_sha256"] = "0" * 64
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    os.utime(paths["train"], ns=(0, 0))
    prepare_tokens(tmp_path, val_fraction=0.2, progress=False)
    assert paths["train"].stat().st_mtime_ns != 0


def test_prepare_tokens_rejects_bad_fraction(tmp_path):
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_tokens(tmp_path, val_fraction=1.0)


def test_load_tokens(prepared, tmp_path):
    data_dir, paths = prepared
    val = load_tokens("val", data_dir)
    assert val.dtype == torch.uint8 and val.dim() == 1
    assert bytes(val.numpy()) == paths["val"].read_bytes()
    fresh = load_tokens("train", tmp_path / "new")  # missing files are prepared on the way
    assert torch.equal(fresh, load_tokens("train", data_dir))
    with pytest.raises(ValueError, match=r"unknown split 'test'.*'train', 'val'"):
        load_tokens("test", data_dir)


# --- RandomBatches -------------------------------------------------------------------------------

def test_random_batches_shape_dtype_and_windows():
    tokens = torch.arange(1000) % 256  # consecutive values: every row must be a contiguous window
    batch = next(RandomBatches(tokens.to(torch.uint8), batch_size=8, block_size=16))
    assert batch.shape == (8, 16) and batch.dtype == torch.long
    assert batch.min() >= 0 and batch.max() < 256
    assert torch.equal((batch[:, 1:] - batch[:, :-1]) % 256, torch.ones(8, 15, dtype=torch.long))
    exact = next(RandomBatches(torch.arange(16), batch_size=3, block_size=16))  # one window fits
    assert torch.equal(exact, torch.arange(16).expand(3, 16))


def test_random_batches_deterministic_per_seed_and_independent_of_global_rng():
    tokens = synthetic_tokens(5000, kind="random")
    torch.manual_seed(1)
    a = [next(it) for it in [RandomBatches(tokens, 4, 32, seed=7)] for _ in range(3)]
    torch.manual_seed(2)  # a different global seed must not change the data order
    b = [next(it) for it in [RandomBatches(tokens, 4, 32, seed=7)] for _ in range(3)]
    c = [next(it) for it in [RandomBatches(tokens, 4, 32, seed=8)] for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_random_batches_leave_the_global_rng_untouched():
    before = torch.get_rng_state()
    batches = RandomBatches(torch.arange(500), 4, 8, seed=3)
    for _ in range(5):
        next(batches)
    assert torch.equal(torch.get_rng_state(), before)


def test_random_batches_resume_exactly_from_state_dict():
    tokens = synthetic_tokens(5000, kind="random")
    run = RandomBatches(tokens, 4, 32, seed=0)
    for _ in range(3):
        next(run)
    buffer = io.BytesIO()
    torch.save(run.state_dict(), buffer)  # as a checkpoint would
    expected = [next(run) for _ in range(5)]
    resumed = RandomBatches(tokens, 4, 32, seed=123)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.batches_drawn == 3
    assert all(torch.equal(x, next(resumed)) for x in expected)
    assert resumed.batches_drawn == 8
    with pytest.raises(ValueError, match="saved block_size=32 but this one has block_size=16"):
        RandomBatches(tokens, 4, 16).load_state_dict(run.state_dict())


def test_random_batches_errors():
    with pytest.raises(ValueError, match="10 tokens, fewer than block_size=64"):
        RandomBatches(torch.arange(10), batch_size=2, block_size=64)
    with pytest.raises(ValueError, match=r"1-D.*\(2, 5\)"):
        RandomBatches(torch.zeros(2, 5, dtype=torch.long), 1, 2)
    with pytest.raises(ValueError, match="integer dtype"):
        RandomBatches(torch.zeros(10), 1, 2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        RandomBatches(torch.arange(10), 0, 2)


# --- eval_batches --------------------------------------------------------------------------------

def test_eval_batches_deterministic_non_overlapping_in_order():
    tokens = torch.arange(1000)
    first, second = list(eval_batches(tokens, 4, 64)), list(eval_batches(tokens, 4, 64))
    assert len(first) == math.ceil((1000 // 64) / 4)
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    rows = torch.cat(first)
    assert rows.dtype == torch.long and rows.shape == (1000 // 64, 64)
    assert torch.equal(rows.flatten(), torch.arange(1000 // 64 * 64))  # each token once, in order
    assert [b.shape[0] for b in first] == [4, 4, 4, 3]
    assert len(list(eval_batches(tokens, 4, 64, max_batches=2))) == 2


def test_eval_batches_errors_are_raised_at_the_call():
    with pytest.raises(ValueError, match="max_batches"):
        eval_batches(torch.arange(100), 2, 8, max_batches=0)
    with pytest.raises(ValueError, match="5 tokens, fewer than block_size=8"):
        eval_batches(torch.arange(5), 2, 8)


# --- synthetic data ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", data.SYNTHETIC_KINDS)
def test_synthetic_tokens_shape_range_determinism(kind):
    a = synthetic_tokens(1001, vocab_size=50, seed=1, kind=kind)
    assert a.shape == (1001,) and a.dtype == torch.long
    assert a.min() >= 0 and a.max() < 50
    assert torch.equal(a, synthetic_tokens(1001, vocab_size=50, seed=1, kind=kind))
    assert not torch.equal(a, synthetic_tokens(1001, vocab_size=50, seed=2, kind=kind))


def test_synthetic_tokens_have_the_documented_structure():
    cycle = synthetic_tokens(2000, kind="cycle")
    successors = collections.defaultdict(set)
    for x, y in zip(cycle[:-1].tolist(), cycle[1:].tolist()):
        successors[x].add(y)
    assert len(successors) == 256 and all(len(s) == 1 for s in successors.values())
    motifs = synthetic_tokens(8000, kind="motifs").view(-1, data.MOTIF_LEN)
    assert len({tuple(row) for row in motifs.tolist()}) <= data.NUM_MOTIFS
    with pytest.raises(ValueError, match="unknown synthetic kind 'zipf'"):
        synthetic_tokens(10, kind="zipf")


def test_a_tiny_model_learns_the_motif_stream_quickly():
    from course_lib.core.model import GPT, GPTConfig
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast and immune to a busy machine
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_preset("tiny", block_size=24))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = RandomBatches(synthetic_tokens(20_000, kind="motifs"), batch_size=8, block_size=24)
        losses = []
        for _ in range(30):
            x = next(batches)
            _, loss = model(x, targets=x)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 0.9 * math.log(256)
    assert sum(losses[-5:]) / 5 < 2.5  # from ln(256) = 5.5 in 30 steps


def test_main_prints_stats_and_prepares_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["course_lib.core.data", "--data-dir", str(tmp_path)])
    data.main()
    out = capsys.readouterr().out
    assert "bytes (tokens) per word" in out and "distinct byte values" in out
    assert (tmp_path / "train.bin").exists() and (tmp_path / "val.bin").exists()
