"""The GPU image (Dockerfile, .dockerignore): what can be checked without Docker and a GPU.

Its instructions parse; the torch it installs is requirements.txt's pin; its base image can build DeepSpeed's ops;
it runs as a non-root user; its smoke test is a Makefile target; the build context leaves out environments,
outputs and student work; and the book quotes the files instead of carrying copies.
"""

import re
import shlex
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "CMD", "ENTRYPOINT", "EXPOSE",
                "LABEL", "VOLUME", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "ONBUILD"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (REPO_ROOT / "Dockerfile").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in filter(str.strip, joined.splitlines()):
        word, _, rest = line.strip().partition(" ")
        assert word in INSTRUCTIONS, f"Dockerfile: {word!r} is not a Dockerfile instruction (line {line!r})"
        found.append((word, rest.strip()))
    return found


def pinned(package: str) -> str:
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.split("==")[1].strip()
    raise AssertionError(f"requirements.txt pins no {package}")


def test_the_dockerfile_parses_and_installs_the_pinned_torch_before_the_requirements():
    found = instructions()
    assert found[0][0] == "FROM"
    args = dict(rest.split("=", 1) for word, rest in found if word == "ARG" and "=" in rest)
    assert args["TORCH_VERSION"] == pinned("torch"), "the image's torch must be requirements.txt's pin"
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"])
    runs = [rest for word, rest in found if word == "RUN"]
    torch_install = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    requirements = next(i for i, r in enumerate(runs) if "pip install -r /tmp/requirements.txt" in r)
    assert torch_install < requirements, "install the CUDA torch first, so that requirements.txt keeps it"
    copies = [shlex.split(rest) for word, rest in found if word == "COPY"]
    assert ["requirements.txt", "/tmp/requirements.txt"] in copies


def test_the_base_image_can_compile_deepspeeds_ops_and_the_user_is_not_root():
    found = instructions()
    base = found[0][1]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?devel-ubuntu\d+\.\d+", base), (
        f"{base}: DeepSpeed compiles FusedAdam and CPU Adam at first use, which needs nvcc (a -devel image)")
    apt = next(rest for word, rest in found if word == "RUN" and "apt-get install" in rest)
    for package in ("g++", "python3-dev", "make"):
        assert f" {package} " in f" {apt} ", f"the image needs {package}"
    users = [rest for word, rest in found if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must run as an unprivileged user"


def test_the_smoke_test_is_make_gpu_check_and_the_makefile_has_it():
    found = instructions()
    cmd = next(rest for word, rest in reversed(found) if word == "CMD")
    assert cmd == '["make", "gpu-check", "VENV=/opt/venv"]'
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^gpu-check: \$\(STAMP\) ## ", makefile, re.M)
    assert "STAMP := $(VENV)/.installed" in makefile
    assert any("touch /opt/venv/.installed" in rest for word, rest in found if word == "RUN"), (
        "mark /opt/venv as installed, or make reinstalls the environment at every start")
    assert (REPO_ROOT / "scripts" / "gpu_check.py").is_file()


def test_the_build_context_leaves_out_environments_outputs_and_student_work():
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "runs", "logs", "data", "submitted", "autograded", "feedback", "gradebook.db"} <= ignored
    assert not ignored & {"course_lib", "notebooks", "solutions", "requirements.txt", "pyproject.toml", "Makefile"}


def test_the_book_quotes_the_files_instead_of_a_copy():
    page = (REPO_ROOT / "book" / "gpu" / "docker.md").read_text(encoding="utf-8")
    assert "```{literalinclude} ../../Dockerfile" in page and "```{literalinclude} ../../.dockerignore" in page
    assert "```dockerfile" not in page, "the page carries its own Dockerfile: quote the repository's"
