"""Give the course's virtual environment a matplotlib cache folder of its own (`make venv` runs this).

matplotlib keeps its font list in ~/.cache/matplotlib/fontlist-v<version>.json, shared by every Python on the
machine. A list written by another installation of the same version (a system package without matplotlib's
bundled STIX and Computer Modern fonts, say) is trusted as it is, and then every figure with mathematical text
or a log-scale axis logs "findfont: Font family ... not found" to stderr. A .pth file in the environment points
MPLCONFIGDIR at <venv>/matplotlib for every interpreter of the environment (notebook kernels included), unless
the user set MPLCONFIGDIR themselves.
"""

import site
import sys
from pathlib import Path

PTH = "course_matplotlib.pth"
LINE = 'import os, sys; os.environ.setdefault("MPLCONFIGDIR", os.path.join(sys.prefix, "matplotlib"))\n'


def main() -> int:
    target = Path(site.getsitepackages()[0]) / PTH
    if sys.prefix == sys.base_prefix:
        print(f"not a virtual environment ({sys.prefix}): {PTH} not written")
        return 0
    target.write_text(LINE)
    print(f"matplotlib cache: {Path(sys.prefix) / 'matplotlib'} ({target.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
