"""A trained tokenizer: byte-level BPE, and token files of any vocabulary size.

The course model reads bytes by default (core.data.ByteTokenizer: 256 ids, one per byte). A real model reads
the ids of a tokenizer trained on its data. Byte-level BPE (GPT-2's scheme, here with Hugging Face `tokenizers`)
starts from the same 256 byte values, so it never meets an unknown character, and learns merges: the pair of
adjacent tokens seen most often in the training text becomes a new token, again and again until the vocabulary
has vocab_size entries. Frequent words become one token; rare ones stay split into pieces or bytes.

    tok = train_bpe(texts, vocab_size=1024)            # seconds on the course corpus
    ids = tok.encode("Return the number of items.")    # 6 ids where bytes need 27
    shard_text_files(["my_texts/"], "data/my_bpe", vocab_size=8192)   # train.bin, val.bin, meta.json, tokenizer.json

Token files: flat arrays of ids with no header, in the smallest unsigned dtype that holds every id (uint8 up to
256 ids, uint16 up to 65,536, uint32 above), so np.memmap reads them directly. meta.json beside them records the
dtype, the vocabulary size, the tokenizer file and the end-of-text id; core.data.load_tokens reads the dtype from
it, and python -m course_lib.train sizes the model's vocabulary from it.

Documents (input files) are joined with the end-of-text token. A file is encoded a block of paragraphs at a
time, cut just before a blank line: the pre-tokenizer never joins text across that point, so the ids are those
of the whole file at once, and memory stays bounded however large the file. The validation split is the last
val_fraction of the tokens, moved back to the nearest paragraph start.

    python scripts/text_to_shards.py my_texts/ --out data/my_bpe --vocab-size 8192
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from array import array
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

import numpy as np

from course_lib.core.checks import positive_int
from course_lib.core.data import CORPUS_FILE, TOKEN_DTYPES, ByteTokenizer, write_atomically

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
END_OF_TEXT = "<|endoftext|>"
BPE_KIND = "byte-level BPE"
_BLOCK_CHARS = 1 << 20  # encode about 1 MB of text at a time
_PARAGRAPH = re.compile(r"(?=\n\n)")  # cut before a blank line: no pre-token spans that point


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds ids 0..vocab_size-1 (one of core.data.TOKEN_DTYPES)."""
    positive_int("vocab_size", vocab_size)
    for name in TOKEN_DTYPES:
        if vocab_size <= np.iinfo(name).max + 1:
            return np.dtype(name)
    raise ValueError(f"vocab_size={vocab_size} does not fit uint32 token ids")


def _tokenizers():
    try:
        import tokenizers
    except ImportError as err:  # a clear line instead of a traceback deep in a notebook
        raise ImportError("Hugging Face `tokenizers` is needed for BPE: pip install -r requirements.txt") from err
    return tokenizers


class BPETokenizer:
    """A trained byte-level BPE tokenizer: encode / decode like ByteTokenizer, plus vocab_size and eot_id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = tokenizer.token_to_id(END_OF_TEXT)
        if self.eot_id is None:
            raise ValueError(f"the tokenizer has no {END_OF_TEXT} token: train it with train_bpe")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def decode(self, ids) -> str:
        """Ids (list or tensor) -> text; the end-of-text token is left out. Bytes cut mid-character become U+FFFD."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in 0..{self.vocab_size - 1} for this tokenizer, got {bad[:5]}")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def pieces(self, text: str) -> list[str]:
        """The text cut into its tokens, as readable strings (a leading space shows as 'Ġ' in the raw vocabulary)."""
        return [self.decode([i]) for i in self.encode(text)]

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(self.tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path) -> BPETokenizer:
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist: train a tokenizer with train_bpe or "
                                    "scripts/text_to_shards.py first")
        return cls(_tokenizers().Tokenizer.from_file(str(path)))


def train_bpe(texts: Iterable[str], vocab_size: int = 1024, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on texts (an iterable of strings: documents or paragraphs).

    The vocabulary is the 256 byte symbols, the end-of-text token, and vocab_size - 257 learned merges. Training
    is deterministic: the same texts give the same tokenizer.
    """
    positive_int("vocab_size", vocab_size)
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges: byte-level BPE starts from 256 byte "
                         f"tokens and {END_OF_TEXT}; ask for at least 258 (the byte tokenizer is ByteTokenizer)")
    positive_int("min_frequency", min_frequency)
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                     special_tokens=[END_OF_TEXT], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return BPETokenizer(tokenizer)


def read_meta(data_dir) -> dict | None:
    """data_dir/meta.json as a dict, or None when there is none."""
    path = Path(data_dir) / META_FILE
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): it should describe the token files beside it") from err
    if not isinstance(meta, dict):
        raise ValueError(f"{path} should hold a JSON object describing the token files, got {type(meta).__name__}")
    return meta


def load_tokenizer(data_dir):
    """The tokenizer that wrote data_dir's token files: BPETokenizer, or ByteTokenizer for byte files."""
    meta = read_meta(data_dir) or {}
    if meta.get("tokenizer") == BPE_KIND:
        return BPETokenizer.load(Path(data_dir) / meta.get("tokenizer_file", TOKENIZER_FILE))
    return ByteTokenizer()


# ---------------------------------------------------------------------------------------------------------------
# Text files -> token files


def text_files(inputs: Iterable, pattern: str = "*.txt") -> list[Path]:
    """The files to read: each input is a file, or a folder searched recursively for pattern (sorted)."""
    found = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += sorted(p for p in path.rglob(pattern) if p.is_file())
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    if not found:
        raise FileNotFoundError(f"no {pattern} files in {', '.join(map(str, inputs))}")
    return found


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}): convert "
                         "it, or leave it out of the inputs") from err


def _blocks(text: str) -> Iterator[list[str]]:
    """The text's paragraphs (each but the first starts at a blank line), in lists of about _BLOCK_CHARS."""
    block, size = [], 0
    for paragraph in _PARAGRAPH.split(text):
        if block and size + len(paragraph) > _BLOCK_CHARS:
            yield block
            block, size = [], 0
        block.append(paragraph)
        size += len(paragraph)
    if block:
        yield block


def _paragraphs(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield from _PARAGRAPH.split(_read_text(path))


def _check_out_dir(out_dir: Path, files: list[Path], force: bool) -> None:
    for path in files:
        source = path.resolve().parent if path.is_file() else path.resolve()
        if out_dir.resolve() == source or source in out_dir.resolve().parents:
            raise ValueError(f"--out {out_dir} is inside the input folder {source}: choose an output folder "
                             "outside your texts, so that nothing is written among them")
    if not out_dir.exists():
        return
    present = sorted(p.name for p in out_dir.iterdir())
    meta = read_meta(out_dir) if (out_dir / META_FILE).exists() else None
    ours = meta is not None and meta.get("tokenizer") == BPE_KIND
    if present and not ours:
        raise FileExistsError(f"{out_dir} already holds files ({', '.join(present[:5])}) that are not token files "
                              "written by this command: nothing is written there; choose an empty or new folder")
    if present and not force:
        raise FileExistsError(f"{out_dir} holds token files from an earlier run ({META_FILE}: vocab_size "
                              f"{meta.get('vocab_size')}, {meta.get('train_tokens')} training tokens): pass "
                              "--force (force=True) to replace them, or choose another folder")


def shard_text_files(inputs, out_dir, *, vocab_size: int = 8192, val_fraction: float = 0.1,
                     tokenizer=None, pattern: str = "*.txt", force: bool = False, log=print) -> dict:
    """Tokenize text files into out_dir: train.bin, val.bin, tokenizer.json and meta.json (written last).

    inputs: files and/or folders (searched recursively for pattern). They are only read. tokenizer: a
    BPETokenizer or the path of a tokenizer.json to reuse (then vocab_size is its own); None trains one on the
    inputs first. Returns the meta dict. out_dir must be outside the inputs; a folder with an earlier run's
    files is replaced only with force=True, and anything else in it is never touched.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    files = text_files(inputs, pattern)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, files, force)
    if tokenizer is None:
        log(f"training a byte-level BPE tokenizer ({vocab_size:,} tokens) on {len(files)} file(s)")
        tokenizer = train_bpe(_paragraphs(files), vocab_size)
    elif not isinstance(tokenizer, BPETokenizer):
        tokenizer = BPETokenizer.load(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    stream = out_dir / f".tokens.tmp{os.getpid()}"
    starts, total, num_bytes, digest = array("q"), 0, 0, hashlib.sha256()
    try:
        with open(stream, "wb") as f:
            for path in files:
                raw = path.read_bytes()
                digest.update(hashlib.sha256(raw).digest())
                num_bytes += len(raw)
                for block in _blocks(_read_text(path)):
                    for ids in tokenizer.encode_batch(block):
                        starts.append(total)  # a paragraph starts here: a place the split may fall
                        np.asarray(ids, dtype=dtype).tofile(f)
                        total += len(ids)
                np.asarray([tokenizer.eot_id], dtype=dtype).tofile(f)  # documents end with end-of-text
                total += 1
        tokens = np.memmap(stream, dtype=dtype, mode="r", shape=(total,))
        target = total - round(total * val_fraction)
        at = bisect.bisect_right(starts, target) - 1  # the last paragraph start at or before the target
        split_at = starts[at] if at >= 0 and starts[at] > target // 2 else target
        if split_at < 1 or split_at >= total:
            raise ValueError(f"the inputs make {total} tokens: too few to split into train and val")
        _write(out_dir / "train.bin", tokens[:split_at])
        _write(out_dir / "val.bin", tokens[split_at:])
        del tokens
    finally:
        stream.unlink(missing_ok=True)
    tokenizer.save(out_dir / TOKENIZER_FILE)
    meta = {"tokenizer": BPE_KIND, "tokenizer_file": TOKENIZER_FILE, "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.name, "eot_id": tokenizer.eot_id, "val_fraction": val_fraction,
            "train_tokens": int(split_at), "val_tokens": int(total - split_at), "files": len(files),
            "source_bytes": num_bytes, "bytes_per_token": round(num_bytes / total, 4),
            "source_sha256": digest.hexdigest()}
    write_atomically(out_dir / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())  # last: marks completion
    log(f"{out_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens ({dtype.name}, "
        f"{num_bytes / total:.2f} bytes per token)")
    return meta


def _write(path: Path, values: np.ndarray) -> None:
    write_atomically(path, np.ascontiguousarray(values).tobytes())


def course_corpus_path() -> Path:
    """The shipped corpus file (a real path: the package is installed from the repository)."""
    return Path(str(resources.files("course_lib").joinpath("corpus", CORPUS_FILE)))
