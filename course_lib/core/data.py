"""Data for the course: a shipped text corpus, a byte-level tokenizer, token files and batches.

Corpus: English prose from the docstrings of Python 3.11's standard library, shipped as
course_lib/corpus/stdlib_docs.txt (built by scripts/build_corpus.py; see corpus/README.md). It needs
no download and is byte-for-byte the same on every machine.

Tokenizer: UTF-8 bytes (ByteTokenizer). Why bytes rather than a trained BPE:
- no training step and no files to ship: the "vocabulary" is the 256 possible byte values;
- no unknown tokens: any string, in any language, encodes and decodes back exactly;
- a vocabulary of 256 keeps the (tied) embedding tiny: 256 x 64 = 16,384 parameters for the tiny
  preset, where GPT-2's 50,257-token vocabulary would need 3.2M, thirty times the whole model.
  A ~100K-parameter model is then mostly transformer blocks, which is what the course studies.
The cost: one token per byte. `corpus_stats()` measures the corpus's bytes per word (about 6.5,
spaces included); a 50K BPE vocabulary spends roughly 1.3-1.5 tokens per English word, so byte
sequences are about 4-5x longer and a context of block_size tokens sees 4-5x less text.

Token files: prepare_tokens() writes data/train.bin and data/val.bin (uint8, one byte per token,
np.memmap-able) and data/meta.json. Batches: RandomBatches (training, own RNG, resumable) and
eval_batches (validation, deterministic). synthetic_tokens() makes learnable streams for fast tests.

    python -m course_lib.core.data                       # corpus statistics, then prepares data/*.bin
    python -m course_lib.core.data --data-dir /tmp/data --force
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from course_lib.core.checks import positive_int, positive_ints

CORPUS_FILE = "stdlib_docs.txt"
SPLITS = ("train", "val")
SYNTHETIC_KINDS = ("motifs", "cycle", "random")
NUM_MOTIFS, MOTIF_LEN = 16, 8
_CHUNK_CHARS = 64 * 1024  # tokenize in chunks so the progress bar moves


class ByteTokenizer:
    """Text <-> token ids, where the ids are the text's UTF-8 bytes (0..255)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Ids (list or tensor) -> text. A sequence cut inside a multi-byte character decodes with
        U+FFFD in its place instead of raising: sampled model output is not always valid UTF-8."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in 0..255 for the byte tokenizer, got {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")


def _corpus_bytes() -> bytes:
    return resources.files("course_lib").joinpath("corpus", CORPUS_FILE).read_bytes()


def load_corpus() -> str:
    """The shipped corpus as one string (about 1.36M characters)."""
    return _corpus_bytes().decode("utf-8")


def corpus_stats(text: str | None = None) -> dict:
    """Characters, whitespace-separated words, UTF-8 bytes (= byte tokens), distinct byte values."""
    text = load_corpus() if text is None else text
    raw = text.encode("utf-8")
    words = len(text.split())
    return {"chars": len(text), "words": words, "bytes": len(raw), "unique_bytes": len(set(raw)),
            "bytes_per_word": len(raw) / max(words, 1)}


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file, fsync, rename: readers see the old file or the new one, never half."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _up_to_date(data_dir: Path, sha: str, val_fraction: float) -> bool:
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        return (meta["corpus_sha256"] == sha and meta["val_fraction"] == val_fraction
                and all((data_dir / f"{s}.bin").stat().st_size == meta[f"{s}_tokens"] for s in SPLITS))
    except (OSError, ValueError, KeyError):
        return False


def _user_files(data_dir: Path) -> list[str]:
    """Token files in data_dir that prepare_tokens did not write (no meta.json of its own beside them)."""
    if (data_dir / "meta.json").exists():
        try:
            if "corpus_sha256" in json.loads((data_dir / "meta.json").read_text()):
                return []  # the course's prepared corpus: prepare_tokens may refresh it
        except (OSError, ValueError):
            pass
    return sorted(p.name for p in data_dir.glob("*.bin")) if data_dir.is_dir() else []


def prepare_tokens(data_dir="data", val_fraction: float = 0.1, force: bool = False,
                   progress: bool = True) -> dict[str, Path]:
    """Tokenize the corpus into data_dir/{train,val}.bin (uint8) and data_dir/meta.json.

    Skips the work when meta.json records the same corpus sha256 and val_fraction and both files
    have the recorded sizes, unless force. The split is contiguous: the last val_fraction of the
    token stream (moved back to the nearest docstring boundary) is validation. Random training
    windows therefore never contain a validation byte, and validation comes from modules the model
    never saw (the corpus is ordered by module), so its loss measures generalisation, not recall.
    With several processes, let one prepare and the others wait (a barrier); writes are atomic anyway.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
    data_dir = Path(data_dir)
    paths = {split: data_dir / f"{split}.bin" for split in SPLITS}
    raw = _corpus_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    if not force and _up_to_date(data_dir, sha, val_fraction):
        return paths
    theirs = _user_files(data_dir)
    if theirs:
        raise FileExistsError(f"{data_dir} holds token files that were not prepared from the course corpus "
                              f"({', '.join(theirs)}, no course meta.json): nothing is written there. Give each "
                              f"split its file ({', '.join(f'{s}.bin' for s in SPLITS)}), or use another data_dir "
                              "for the course corpus")
    text, tokenizer = raw.decode("utf-8"), ByteTokenizer()
    tokens = np.empty(len(raw), dtype=np.uint8)  # byte ids fit uint8: 1 byte per token on disk
    filled = 0
    with tqdm(total=len(text), unit="char", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        for start in range(0, len(text), _CHUNK_CHARS):
            chunk = text[start:start + _CHUNK_CHARS]
            ids = tokenizer.encode(chunk)
            tokens[filled:filled + len(ids)] = ids
            filled += len(ids)
            bar.update(len(chunk))
    assert filled == len(raw), "chunked encoding must produce exactly the corpus bytes"
    split_at = len(raw) - round(len(raw) * val_fraction)
    boundary = raw.rfind(b"\n\n", 0, split_at)  # don't cut a docstring in half
    split_at = boundary + 2 if boundary > 0 else split_at
    data_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(paths["train"], tokens[:split_at].tobytes())
    write_atomically(paths["val"], tokens[split_at:].tobytes())
    meta = {"tokenizer": "utf-8 bytes", "vocab_size": ByteTokenizer.vocab_size, "dtype": "uint8",
            "corpus": CORPUS_FILE, "corpus_sha256": sha, "val_fraction": val_fraction,
            "train_tokens": split_at, "val_tokens": len(raw) - split_at}
    write_atomically(data_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())  # last: marks completion
    return paths


TOKEN_DTYPES = {"uint8": (np.uint8, np.uint8), "uint16": (np.uint16, np.int32), "uint32": (np.uint32, np.int64)}
"""Token file dtype (meta.json "dtype") -> (how the file is read, the dtype its tensor holds: uint16 and uint32 ids
are widened to a signed type, which every torch indexing op accepts)."""


def token_file_dtype(data_dir) -> str:
    """The dtype of data_dir's token files: meta.json's "dtype" (core.tokenizer writes uint16 / uint32 files),
    uint8 when there is no meta.json (byte files)."""
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        return "uint8"
    try:
        dtype = json.loads(path.read_text()).get("dtype", "uint8")
    except (ValueError, AttributeError) as err:
        raise ValueError(f"{path} is not a JSON object describing the token files beside it: {err}") from err
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{path} says dtype {dtype!r}: token files must be one of {sorted(TOKEN_DTYPES)}")
    return dtype


def load_tokens(split: str, data_dir="data") -> torch.Tensor:
    """The split's tokens as a 1-D integer tensor (prepares the course's byte files first if they are missing).

    The file's dtype comes from meta.json beside it (uint8 for bytes, uint16 / uint32 for a trained tokenizer's
    ids). uint8 is kept as uint8, 8x smaller than int64; RandomBatches and eval_batches hand out int64
    (torch.long) batches, which is what nn.Embedding and cross_entropy want.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")
    path = Path(data_dir) / f"{split}.bin"
    if not path.exists():
        theirs = _user_files(Path(data_dir))
        if theirs:  # the user's own data: never replace it with the course corpus
            raise FileNotFoundError(f"{path} is missing: {data_dir} holds your token files ({', '.join(theirs)}) "
                                    f"and no {split} split. Add {split}.bin (uint8 token ids), or point data_dir "
                                    "at a folder with both splits")
        prepare_tokens(data_dir)
    dtype = token_file_dtype(data_dir)
    file_dtype, held_dtype = TOKEN_DTYPES[dtype]
    size, itemsize = path.stat().st_size, np.dtype(file_dtype).itemsize
    if size % itemsize:
        raise ValueError(f"{path} holds {size} bytes, not a whole number of {dtype} token ids ({itemsize} bytes "
                         f"each, as {Path(data_dir) / 'meta.json'} says): the file is cut short or not a {dtype} file")
    tokens = torch.from_numpy(np.fromfile(path, dtype=file_dtype).astype(held_dtype, copy=False))
    if len(tokens) == 0:
        raise ValueError(f"{path} is empty: the {split} split has no tokens")
    return tokens


def _check_stream(tokens, batch_size: int, block_size: int) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be a 1-D torch.Tensor of token ids, got {shape}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
    positive_ints(batch_size=batch_size, block_size=block_size)
    if len(tokens) < block_size:
        raise ValueError(f"tokens has {len(tokens)} tokens, fewer than block_size={block_size}: "
                         "not even one window fits; use a smaller block_size or more data")


class RandomBatches:
    """Endless (batch_size, block_size) torch.long batches of windows at random offsets.

    Offsets come from the iterator's own torch.Generator, never the global RNG, so model init or
    dropout cannot change the data order, and state_dict() / load_state_dict() resume a run with
    exactly the batches it would have drawn. The model shifts targets itself, so a batch x is used
    as model(x, targets=x). In data-parallel training give each rank its own seed (seed + rank).
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, block_size: int, seed: int = 0):
        _check_stream(tokens, batch_size, block_size)
        self.tokens, self.batch_size, self.block_size, self.seed = tokens, batch_size, block_size, seed
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0
        self._positions = torch.arange(block_size)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.block_size + 1, (self.batch_size,),
                               generator=self.generator)
        self.batches_drawn += 1
        return self.tokens[starts[:, None] + self._positions].long()  # (batch_size, block_size)

    def state_dict(self) -> dict:
        return {"generator_state": self.generator.get_state(), "batches_drawn": self.batches_drawn,
                "batch_size": self.batch_size, "block_size": self.block_size,
                "num_tokens": len(self.tokens), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key in ("batch_size", "block_size", "num_tokens"):
            mine = len(self.tokens) if key == "num_tokens" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"cannot resume RandomBatches: saved {key}={state[key]} but this one has {key}={mine}")
        self.generator.set_state(state["generator_state"])
        self.batches_drawn, self.seed = state["batches_drawn"], state["seed"]


def eval_batches(tokens: torch.Tensor, batch_size: int, block_size: int, max_batches: int | None = None):
    """Deterministic validation batches: consecutive non-overlapping windows, in order.

    Every call yields the same (batch_size, block_size) torch.long batches (the last one may have
    fewer rows; weight by rows when averaging). Tokens after the last whole window are not used.
    """
    _check_stream(tokens, batch_size, block_size)
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches <= 0):
        raise ValueError(f"max_batches must be None or a positive integer, got {max_batches!r}")
    num_windows = len(tokens) // block_size
    windows = tokens[: num_windows * block_size].reshape(num_windows, block_size)
    starts = range(0, num_windows, batch_size)
    if max_batches is not None:
        starts = starts[:max_batches]
    return (windows[s:s + batch_size].long() for s in starts)


def synthetic_tokens(num_tokens: int, vocab_size: int = 256, seed: int = 0, kind: str = "motifs") -> torch.Tensor:
    """A 1-D torch.long stream that a model learns in a few steps (for fast tests).

    kind="motifs": NUM_MOTIFS random motifs of MOTIF_LEN tokens, concatenated in random order.
      Only a motif's first token is a surprise, so the best loss is about ln(16) / 8 = 0.35 nats/token
      against ln(vocab_size) for an untrained model.
    kind="cycle": a fixed random permutation of the vocabulary repeated: each token fixes the next
      one, so the loss can go to 0.
    kind="random": i.i.d. uniform tokens: nothing to learn; the loss stays at ln(vocab_size).
    """
    positive_int("num_tokens", num_tokens)
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}: expected one of {SYNTHETIC_KINDS}")
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randint(0, vocab_size, (num_tokens,), generator=g)
    if kind == "cycle":
        return torch.randperm(vocab_size, generator=g)[torch.arange(num_tokens) % vocab_size]
    motifs = torch.randint(0, vocab_size, (NUM_MOTIFS, MOTIF_LEN), generator=g)
    order = torch.randint(0, NUM_MOTIFS, (-(-num_tokens // MOTIF_LEN),), generator=g)
    return motifs[order].flatten()[:num_tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description="Print corpus statistics and prepare the token files.")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--force", action="store_true", help="rewrite the token files even if up to date")
    args = parser.parse_args()
    stats = corpus_stats()
    print(f"corpus {CORPUS_FILE}: {stats['chars']:,} characters, {stats['words']:,} words, "
          f"{stats['bytes']:,} bytes = byte tokens, {stats['unique_bytes']} distinct byte values")
    print(f"bytes (tokens) per word: {stats['bytes_per_word']:.2f}")
    paths = prepare_tokens(args.data_dir, args.val_fraction, args.force)
    meta = json.loads((Path(args.data_dir) / "meta.json").read_text())
    for split, path in paths.items():
        print(f"{split}: {meta[f'{split}_tokens']:,} tokens in {path}")
    batch = next(RandomBatches(load_tokens("val", args.data_dir), batch_size=1, block_size=80, seed=0))
    print(f"a validation window: {ByteTokenizer().decode(batch[0])!r}")


if __name__ == "__main__":
    main()
