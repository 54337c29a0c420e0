"""The course library: one sub-package per concept (course_lib/README.md lists them).

The names most notebooks need are importable from here; each is imported on first use, so that
`import course_lib` (which every spawned rank does) stays cheap:

    from course_lib import launch, GPT, GPTConfig, repo_root
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, tuple[str, ...]]):
    """(__getattr__, __dir__, __all__) for a package that re-exports `table` = {module: (name, ...)} lazily.

    A name's module is imported the first time the name is asked for (PEP 562), then cached on the package.
    """
    where = {name: module for module, names in table.items() for name in names}
    if len(where) != sum(len(names) for names in table.values()):
        raise ValueError(f"{package}: a name is exported by two modules")
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__, sorted(where)


__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "runtime.launch": ("launch", "RankFailure"),
    "runtime.env": ("get_dist_info", "init_distributed", "cleanup"),
    "core.model": ("GPT", "GPTConfig"),
    "core.device": ("select_device",),
    "nbtools": ("repo_root", "expect_error"),
})
