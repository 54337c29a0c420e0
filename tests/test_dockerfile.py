"""The GPU images (Dockerfile, .dockerignore, course.def): what can be checked without Docker, Apptainer and a GPU.

The Dockerfile's instructions parse; the torch it installs is requirements.txt's pin; its base image can build
DeepSpeed's ops and has the libraries for NVMe offload and InfiniBand; it runs as a non-root user; its smoke test
is a Makefile target; the learner image (the default target) holds no layer with solutions/, the instructor image
adds them, and every other part of the repository is in both; the build context leaves out environments, outputs
and student work; the Apptainer definition builds from the learner image and runs read-only; and the book quotes
the files instead of carrying copies.
"""

import fnmatch
import re
import shlex
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "CMD", "ENTRYPOINT", "EXPOSE",
                "LABEL", "VOLUME", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "ONBUILD"}
IMAGE_TAG = "distributed-llm-course:gpu"
IMAGE_REPO = "/home/course/course"
# Top-level entries of the repository that no image needs: the image recipes themselves, CI, git's files.
NOT_IN_IMAGES = {"Dockerfile", ".dockerignore", "course.def", ".ci", ".gitignore", ".gitattributes"}


def dockerfile_text() -> str:
    return (REPO_ROOT / "Dockerfile").read_text(encoding="utf-8")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in dockerfile_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in filter(str.strip, joined.splitlines()):
        word, _, rest = line.strip().partition(" ")
        assert word in INSTRUCTIONS, f"Dockerfile: {word!r} is not a Dockerfile instruction (line {line!r})"
        found.append((word, " ".join(rest.split())))
    return found


def stages() -> dict[str, dict]:
    """{stage name: {"base": what it starts FROM, "steps": [(INSTRUCTION, arguments)]}}, in file order."""
    found: dict[str, dict] = {}
    current = None
    for word, rest in instructions():
        if word == "FROM":
            image, _, name = re.fullmatch(r"(\S+)(\s+AS\s+(\S+))?", rest, re.I).groups()
            assert name, f"name every stage (FROM {rest})"
            current = found.setdefault(name, {"base": image, "steps": []})
        elif current is not None:
            current["steps"].append((word, rest))
    return found


def chain(name: str) -> list[str]:
    """The stage and every stage it builds on, the first one last."""
    all_stages, names = stages(), []
    while name in all_stages:
        names.append(name)
        name = all_stages[name]["base"]
    return names


def copies(names: list[str]) -> list[list[str]]:
    """COPY arguments (flags dropped) of these stages: [source, ..., destination]."""
    all_stages = stages()
    return [[arg for arg in shlex.split(rest) if not arg.startswith("--")]
            for name in names for word, rest in all_stages[name]["steps"] if word == "COPY"]


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
    assert any("requirements.txt" in c[:-1] and c[-1].startswith("/tmp/") for c in copies(list(stages())))
    # DeepSpeed belongs to the GPU image, installed against the pins (it must not move torch)
    assert "pip install -r /tmp/requirements-deepspeed.txt -c /tmp/requirements.txt" in runs[requirements]


def test_the_base_image_can_compile_deepspeeds_ops_offload_to_nvme_and_use_infiniband():
    found = instructions()
    base = found[0][1].split()[0]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?devel-ubuntu\d+\.\d+", base), (
        f"{base}: DeepSpeed compiles FusedAdam and CPU Adam at first use, which needs nvcc (a -devel image)")
    apt = next(rest for word, rest in found if word == "RUN" and "apt-get install" in rest)
    packages = set(apt.split())
    for package in ("g++", "python3-dev", "make", "libaio-dev", "libibverbs1", "ibverbs-providers", "rdma-core"):
        assert package in packages, f"the image needs {package}"
    # Ubuntu 24.04 renamed librdmacm1 to librdmacm1t64 (64-bit time_t); either is the same library
    assert packages & {"librdmacm1", "librdmacm1t64"}, "the image needs librdmacm (RDMA connection manager)"
    if "ubuntu24.04" in base:
        assert "librdmacm1t64" in packages
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


def test_the_default_target_is_the_learner_image_without_solutions():
    all_stages = stages()
    assert list(all_stages)[-1] == "learner", "a build without --target gives the last stage: the learner image"
    assert {"learner", "instructor"} <= set(all_stages)
    learner = copies(chain("learner"))
    sources = [source.rstrip("/") for copy in learner for source in copy[:-1]]
    assert "solutions" not in sources and "." not in sources, (
        f"no layer of the learner image may hold solutions/ (answers, hidden tests): {learner}")
    assert all(not source.startswith(("solutions/", "./solutions")) for source in sources)
    instructor = copies(chain("instructor"))
    assert ["solutions", "solutions/"] in instructor, "the instructor image adds solutions/"
    # the grading suite's mutants and right answers written differently: left out of the learner's tests/
    steps = [rest for name in chain("learner") for word, rest in stages()[name]["steps"] if word == "COPY"]
    tests_copy = next(rest for rest in steps if shlex.split(rest)[-1] == "tests/")
    assert "--exclude=course/test_grading.py" in tests_copy, tests_copy
    assert ["tests/course/test_grading.py", "tests/course/"] in instructor
    # The instructor image is the learner's repository plus solutions/: the same stages below it
    assert chain("instructor")[1:] == chain("learner")[1:]
    workdir = [rest for name in chain("learner") for word, rest in all_stages[name]["steps"] if word == "WORKDIR"]
    assert workdir[-1] == IMAGE_REPO


def repository_entries() -> set[str]:
    """Top-level files and folders of the repository: git's tracked and untracked-but-not-ignored ones."""
    done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    if done.returncode == 0:
        return {line.split("/")[0] for line in done.stdout.splitlines() if line}
    return {path.name for path in REPO_ROOT.iterdir()}


def test_the_learner_image_has_every_part_of_the_repository_but_solutions():
    """The Dockerfile copies folder by folder: a new top-level folder must be added there (or ignored)."""
    ignored = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copied = {source.rstrip("/") for copy in copies(chain("learner")) for source in copy[:-1]}
    needed = {entry for entry in repository_entries() if (REPO_ROOT / entry).exists()
              and not any(fnmatch.fnmatch(entry, pattern) for pattern in ignored)} - NOT_IN_IMAGES - {"solutions"}
    assert needed <= copied, f"not copied into the images: {sorted(needed - copied)} (add a COPY line)"
    assert copied <= needed | {"requirements-deepspeed.txt"}, f"copied but not in the repository: {copied - needed}"
    for folder in ("runs", "logs", "data"):  # mount points, where the course writes
        assert f"{IMAGE_REPO}/{folder}" in dockerfile_text()


def test_the_header_shows_how_to_build_and_run_it():
    header = dockerfile_text().split("\nFROM ")[0]
    assert f"docker build --platform linux/amd64 --target learner -t {IMAGE_TAG} ." in header
    assert "--target instructor" in header
    assert re.search(r"docker run --rm --gpus all --ipc=host --shm-size=16g \S*distributed-llm-course:gpu", header)
    assert re.search(r"^# .*/dev/shm.*64 MB", header, re.M), "say why: DataLoader workers and NCCL use /dev/shm"
    assert "arm64" in header and "emulation" in header


def test_the_build_context_leaves_out_environments_outputs_and_student_work():
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "runs", "logs", "data", "submitted", "autograded", "feedback", "gradebook.db",
            "*.sif"} <= ignored
    # solutions/ stays in the context: the instructor target copies it (.dockerignore applies to every target)
    assert not ignored & {"course_lib", "notebooks", "solutions", "requirements.txt", "pyproject.toml", "Makefile",
                          "requirements-deepspeed.txt"}


def apptainer_sections() -> tuple[dict[str, str], dict[str, str]]:
    """(header keywords such as Bootstrap and From, {section name: its text}) of course.def."""
    header, sections, current = {}, {}, None
    for line in (REPO_ROOT / "course.def").read_text(encoding="utf-8").splitlines():
        if line.startswith("%"):
            current = line[1:].split()[0]
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
        elif re.match(r"^[A-Za-z]+:", line):
            key, value = line.split(":", 1)
            header[key] = value.strip()
    return header, sections


def test_the_apptainer_definition_builds_the_learner_image_and_runs_read_only():
    header, sections = apptainer_sections()
    assert header["Bootstrap"] in ("docker-daemon", "docker") and header["From"].endswith(IMAGE_TAG)
    assert {"environment", "runscript", "help"} <= set(sections)
    text = (REPO_ROOT / "course.def").read_text(encoding="utf-8")
    for way in ("docker-daemon://distributed-llm-course:gpu", "docker://", "docker-archive://"):
        assert f"apptainer build course.sif {way}" in text
    assert f"cd {IMAGE_REPO}" in sections["runscript"] and "make gpu-check VENV=/opt/venv" in sections["runscript"]
    environment = sections["environment"]
    assert "PYTHONDONTWRITEBYTECODE=1" in environment and "no:cacheprovider" in environment  # nothing to write
    assert "COURSE_OUTPUT_ROOT" not in re.sub(r"#.*", "", environment), (
        "a %environment value cannot be overridden from the host: leave COURSE_OUTPUT_ROOT to the job")
    subprocess.run(["bash", "-n"], input="\n".join(
        [sections["environment"], sections["runscript"]]), text=True, check=True)  # the shell parts parse


def test_the_book_quotes_the_files_instead_of_a_copy():
    page = (REPO_ROOT / "book" / "gpu" / "docker.md").read_text(encoding="utf-8")
    for name in ("Dockerfile", ".dockerignore", "course.def"):
        assert f"```{{literalinclude}} ../../{name}" in page, name
    assert "```dockerfile" not in page, "the page carries its own Dockerfile: quote the repository's"
