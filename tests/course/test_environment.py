"""The pinned environment: requirements.txt, environment.yml and the installed packages agree.

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


def requirements_pins() -> dict[str, str]:
    path = REPO_ROOT / "requirements.txt"
    return parse_pins(path.read_text(encoding="utf-8").splitlines(), "requirements.txt")


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
