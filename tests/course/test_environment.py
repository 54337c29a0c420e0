"""The pinned environment: requirements.txt, environment.yml, the optional extras and the installed packages agree.

    .venv/bin/python -m pytest -q tests/course/test_environment.py
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCH_VERSION = "2.13.0"


def parse_pins(lines: list[str], where: str) -> dict[str, str]:
    """{canonical name: version} of `name==version` lines; anything else but comments and pip options fails."""
    pins = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):  # blank, comment, or a pip option such as `-e .`
            continue
        requirement = Requirement(line)
        specs = list(requirement.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", (
            f"{where}: {line!r} is not pinned; every package must be `name==version`")
        name = canonicalize_name(requirement.name)
        assert name not in pins, f"{where}: {requirement.name} is listed twice"
        pins[name] = specs[0].version
    return pins


def requirements_pins(name: str = "requirements.txt") -> dict[str, str]:
    path = REPO_ROOT / name
    return parse_pins(path.read_text(encoding="utf-8").splitlines(), name)


EXTRAS = {"deepspeed": "requirements-deepspeed.txt"}
"""Optional extras: `make venv EXTRAS=<name>` installs requirements-<name>.txt on top of requirements.txt."""


def environment_yml() -> dict:
    return yaml.safe_load((REPO_ROOT / "environment.yml").read_text(encoding="utf-8"))


def environment_parts() -> tuple[list[str], dict[str, str]]:
    """(conda dependencies as written, {name: version} of the pip section) of environment.yml."""
    conda_deps, pip_lines = [], []
    for dep in environment_yml()["dependencies"]:
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, f"environment.yml: unexpected dependency block {dep}"
            pip_lines += dep["pip"]
        else:
            conda_deps.append(str(dep))
    return conda_deps, parse_pins(pip_lines, "environment.yml (pip section)")


def test_requirements_are_all_pinned_and_torch_is_the_course_version():
    pins = requirements_pins()
    assert pins, "requirements.txt lists no packages"
    assert pins.get("torch") == TORCH_VERSION, f"requirements.txt must pin torch=={TORCH_VERSION}"


def test_environment_yml_pins_the_same_packages_and_versions():
    _, env_pins = environment_parts()
    req_pins = requirements_pins()
    only_req = sorted(set(req_pins) - set(env_pins))
    only_env = sorted(set(env_pins) - set(req_pins))
    assert not only_req and not only_env, (
        f"requirements.txt and environment.yml list different packages: only in requirements.txt {only_req}, "
        f"only in environment.yml {only_env}")
    differ = {name: (req_pins[name], env_pins[name]) for name in req_pins if req_pins[name] != env_pins[name]}
    assert not differ, f"versions differ (requirements.txt, environment.yml): {differ}"


def test_environment_yml_states_a_python_version_course_lib_supports():
    conda_deps, _ = environment_parts()
    pythons = [dep for dep in conda_deps if re.match(r"python\s*[=<>]", dep)]
    assert len(pythons) == 1, f"environment.yml must state one python version, found {pythons or 'none'}"
    version = re.sub(r"^python\s*=+\s*", "", pythons[0]).rstrip(".*")
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", version), f"environment.yml: cannot read a version from {pythons[0]!r}"
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    requires = re.search(r'requires-python\s*=\s*"([^"]+)"', pyproject)
    assert requires, "pyproject.toml states no requires-python"
    assert Version(version) in SpecifierSet(requires.group(1)), (
        f"environment.yml asks for python {version}, but pyproject.toml requires {requires.group(1)}")
    # Everything else is conda's pip (the packages themselves come from the pip section).
    assert [dep for dep in conda_deps if dep not in pythons] == ["pip"], (
        f"environment.yml: packages outside the pip section drift from requirements.txt: {conda_deps}")


def test_environment_yml_installs_course_lib():
    pip_lines = next(dep["pip"] for dep in environment_yml()["dependencies"] if isinstance(dep, dict))
    assert "-e ." in [line.strip() for line in pip_lines], "environment.yml must install course_lib (`-e .`)"


@pytest.mark.parametrize("name", sorted(requirements_pins()))
def test_installed_version_matches_the_pin(name):
    pinned = requirements_pins()[name]
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{name}=={pinned} is pinned in requirements.txt but not installed in {sys.prefix} "
                    "(run `make venv`)")
    # `==2.13.0` accepts a local build label such as 2.13.0+cpu, as pip does.
    assert Version(installed) in SpecifierSet(f"=={pinned}"), (
        f"{name}: requirements.txt pins {pinned}, {sys.prefix} has {installed} (run `make venv` to re-sync)")


def test_course_lib_is_installed_from_this_repository():
    import course_lib

    assert Path(course_lib.__file__).resolve().is_relative_to(REPO_ROOT), (
        f"course_lib is imported from {course_lib.__file__}, not from {REPO_ROOT} (run `make venv`)")


def test_deepspeed_is_an_optional_extra_that_moves_no_pin():
    """DeepSpeed ships only sources: the default install leaves it out, `make venv EXTRAS=deepspeed` adds it."""
    base = requirements_pins()
    assert "deepspeed" not in base, "requirements.txt must install without building anything: DeepSpeed is an extra"
    for extra, name in EXTRAS.items():
        pins = requirements_pins(name)
        assert extra in pins and not set(pins) & set(base), f"{name}: {pins} (repeats requirements.txt: not allowed)"
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    assert "$(VENV)/.installed-%: requirements-%.txt $(STAMP)" in makefile
    assert "-r $< -c requirements.txt" in makefile  # installed against requirements.txt's pins
    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    extras = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", pyproject, re.M | re.S)
    assert extras and re.search(r'^deepspeed = \["deepspeed', extras.group(1), re.M), (
        "pyproject.toml offers course_lib[deepspeed] too")
    dockerfile = (REPO_ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert "requirements-deepspeed.txt" in dockerfile  # the GPU image has it


@pytest.mark.parametrize("name", sorted(requirements_pins(EXTRAS["deepspeed"])))
def test_an_installed_extra_matches_its_pin(name):
    pinned = requirements_pins(EXTRAS["deepspeed"])[name]
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{'DeepSpeed' if name == 'deepspeed' else name} is not installed: make venv EXTRAS=deepspeed")
    assert Version(installed) in SpecifierSet(f"=={pinned}"), (
        f"{name}: requirements-deepspeed.txt pins {pinned}, {sys.prefix} has {installed} "
        "(run `make venv EXTRAS=deepspeed` to re-sync)")
