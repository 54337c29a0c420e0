"""Turn a folder of your own text files into token files the course trains on.

    python scripts/text_to_shards.py my_texts/ --out data/my_bpe --vocab-size 8192
    python -m course_lib.train --data_dir data/my_bpe --model_size small --max_steps 2000

Reads every *.txt under the inputs (files or folders, recursively; --pattern to change), trains a byte-level BPE
tokenizer on them (or reuses one: --tokenizer data/other/tokenizer.json), and writes to --out: train.bin and
val.bin (token ids, uint16 up to 65,536 tokens, uint32 above), tokenizer.json and meta.json (dtype, vocab_size,
end-of-text id, token counts). Your files are only read: --out must be a new or empty folder outside them, or
one this command wrote before (replaced only with --force). Each file is one document; documents are joined
with the end-of-text token; validation is the last --val-fraction of the tokens, cut at a paragraph start.
course_lib/core/tokenizer.py has the details.
"""

import argparse
import sys

from course_lib.core.tokenizer import shard_text_files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/text_to_shards.py", description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="text files and/or folders of them (only read)")
    parser.add_argument("--out", required=True, help="folder for train.bin, val.bin, tokenizer.json, meta.json")
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokens in the trained vocabulary (default 8192)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of tokens for validation (default 0.1)")
    parser.add_argument("--tokenizer", help="a tokenizer.json to reuse instead of training one")
    parser.add_argument("--pattern", default="*.txt", help="which files of a folder to read (default *.txt)")
    parser.add_argument("--force", action="store_true", help="replace the token files of an earlier run in --out")
    args = parser.parse_args(argv)
    try:
        shard_text_files(args.inputs, args.out, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                         tokenizer=args.tokenizer, pattern=args.pattern, force=args.force)
    except (ValueError, OSError, ImportError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(f"train with: python -m course_lib.train --data_dir {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
