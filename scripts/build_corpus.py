"""Build the course corpus: English prose from the docstrings of Python's standard library.

The result is shipped as course_lib/corpus/stdlib_docs.txt, so every machine trains on the same
bytes without downloading anything. Rebuild it (only needed if the recipe below changes) with:

    python scripts/build_corpus.py                # writes course_lib/corpus/stdlib_docs.txt
    python scripts/build_corpus.py --check        # rebuilds in memory, compares with the shipped file

Recipe, deterministic for a given Python version (the shipped file comes from Python 3.11):
1. every .py file under sysconfig.get_paths()['stdlib'], sorted by relative path, skipping test
   suites and tools that are not library prose (SKIP_DIRS);
2. module, class and function docstrings via `ast`, in source order (`ast.get_docstring` dedents);
3. cleaning: doctest examples (a `>>>` line up to the next blank line) are removed because they are
   code, not prose; trailing spaces are stripped; runs of blank lines collapse into one;
4. docstrings shorter than MIN_CHARS are dropped (mostly one-liners such as "Return self."),
   which also brings the corpus to about 1.3 MB; exact duplicates are kept once;
5. docstrings are joined with one blank line between them.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sys
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "__pycache__",
             "turtledemo", "pydoc_data"}
MIN_CHARS = 80
BUILT_WITH = (3, 11)
OUTPUT = Path(__file__).resolve().parent.parent / "course_lib" / "corpus" / "stdlib_docs.txt"


def stdlib_files(root: Path) -> list[Path]:
    """Sorted .py files of the standard library, without the directories in SKIP_DIRS."""
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def docstrings(tree: ast.AST):
    """Module, class and function docstrings in source order (depth first, unlike ast.walk)."""
    if isinstance(tree, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        text = ast.get_docstring(tree, clean=True)
        if text:
            yield text
    for child in ast.iter_child_nodes(tree):
        yield from docstrings(child)


def clean(text: str) -> str:
    """Drop doctest examples and trailing spaces; collapse runs of blank lines."""
    kept, in_doctest = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>"):
            in_doctest = True
        elif not stripped:
            in_doctest = False
        if not in_doctest:
            kept.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


def build_corpus(root: Path, max_files: int | None = None) -> str:
    """The corpus text from the first max_files files (all by default); a prefix of the full text."""
    seen: set[str] = set()
    pieces: list[str] = []
    for path in stdlib_files(root)[:max_files]:
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError) as err:  # a few stdlib files are templates, not Python
            print(f"skipping {path.relative_to(root)}: {err}", file=sys.stderr)
            continue
        for text in map(clean, docstrings(tree)):
            if len(text) >= MIN_CHARS and text not in seen:
                seen.add(text)
                pieces.append(text)
    return "\n\n".join(pieces) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--check", action="store_true", help="compare with the shipped file, write nothing")
    args = parser.parse_args()
    if sys.version_info[:2] != BUILT_WITH:
        print(f"warning: the shipped corpus was built with Python {BUILT_WITH[0]}.{BUILT_WITH[1]}; "
              f"this is {sys.version.split()[0]}, so the text will differ", file=sys.stderr)
    root = Path(sysconfig.get_paths()["stdlib"])
    data = build_corpus(root).encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    if args.check:
        same = args.output.exists() and args.output.read_bytes() == data
        print(f"rebuilt {len(data):,} bytes, sha256 {digest}: {'identical to' if same else 'DIFFERS from'} {args.output}")
        sys.exit(0 if same else 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(data)
    print(f"wrote {args.output} ({len(data):,} bytes, {len(stdlib_files(root))} files scanned, sha256 {digest})")


if __name__ == "__main__":
    main()
