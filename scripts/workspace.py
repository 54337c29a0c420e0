"""The learner's workspace: a copy of notebooks/ that nothing regenerates (`make lab` opens it).

    python scripts/workspace.py                 # create workspace/ or add the notebooks it lacks; never overwrite
    python scripts/workspace.py --dir my_work

notebooks/ is what `make release` regenerates from solutions/, so work saved there can be overwritten by the
next release (which refuses unless --force, but still). workspace/ is ignored by git and only ever gains
notebooks: a notebook already there is never replaced, even when a newer version is released; the script says
which released notebooks are newer than your copy, so you can compare them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = "workspace"


def sync_workspace(root: Path = REPO_ROOT, workspace: Path | None = None) -> dict[str, list[Path]]:
    """Copy every notebooks/<assignment>/<name>.ipynb the workspace lacks. Returns {"added": [...], "newer": [...]}:
    the notebooks copied, and the released notebooks that changed after the learner's copy was made."""
    root = Path(root)
    workspace = Path(workspace) if workspace is not None else root / WORKSPACE
    released = sorted((root / "notebooks").glob("*/*.ipynb"))
    if not released:
        raise FileNotFoundError(f"no notebooks under {root / 'notebooks'}: run `make release` first")
    added, newer = [], []
    for source in released:
        mine = workspace / source.parent.name / source.name
        if not mine.exists():
            mine.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, mine)
            added.append(mine)
        elif source.stat().st_mtime > mine.stat().st_mtime and source.read_bytes() != mine.read_bytes():
            newer.append(source)
    return {"added": added, "newer": newer}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=REPO_ROOT / WORKSPACE, help="the workspace folder")
    args = parser.parse_args(argv)
    result = sync_workspace(REPO_ROOT, args.dir)
    print(f"your notebooks: {args.dir} (release never writes there; your work stays)"
          + (f"; {len(result['added'])} notebook(s) added" if result["added"] else ""))
    for path in result["newer"]:
        print(f"  a newer release of {path.relative_to(REPO_ROOT)} exists; your copy is kept (compare them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
