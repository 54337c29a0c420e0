"""Read a learner's answer cell before it runs, and refuse what is not an answer.

A graded check runs the learner's answer and then the exercise's tests in one process (see sandbox.py),
so an answer could otherwise change the tests instead of passing them. `audit(answer, reference, context)`
returns one `Violation` per line that does any of these, each with a message that names it:

* **delegation**: a name the exercise asks for is not written with `def`/`class` in the cell (bound to
  course_lib's version instead); the answer calls what it should write (`super().forward(...)` inside
  `forward`, `library.causal_attention`), or uses a course_lib name from the setup cells that the
  reference answer does not need;
* **changing the checks**: it rebinds a name of the setup cells or a builtin (`isinstance = ...`,
  `library_optim = ...`), writes an attribute or item of a module or of a setup object
  (`torch.testing.assert_close = ...`, `library.MLP = MLP`), or declares such a name `global`;
* **changing the interpreter**: exec/eval/compile, get_ipython, setattr/delattr, globals(),
  imports of sys, builtins, importlib, inspect, unittest (mock), ctypes, gc, subprocess, threading ...
  (any import outside a short list of the standard library, torch and numpy), dunder attributes and
  frame objects (`x.__class__`, `f.f_back`), exits (`os._exit`, `os.kill`, `os.exec*`);
* **lying objects**: a class that derives from a builtin value type or defines how it compares
  (`__eq__`, `__bool__`, `__hash__`, ...).

Whatever the reference answer itself does is always allowed, so an exercise can need any of it. A test cell
may name more that answers must not use, in a comment line such as
`# Not in the answer: torch.amp.GradScaler` (what its hidden tests compare with).
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass

ALLOWED_MODULES = frozenset({
    "math", "os", "os.path", "pathlib", "tempfile", "contextlib", "collections", "collections.abc", "itertools",
    "functools", "dataclasses", "typing", "json", "time", "random", "re", "shutil", "copy", "operator", "heapq",
    "bisect", "statistics", "fractions", "enum", "abc", "string", "textwrap", "numbers", "hashlib", "datetime",
    "numpy", "torch",
})
"""Modules an answer may import (and their submodules for torch); anything else is refused."""

CALLS_REFUSED = frozenset({
    "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "setattr", "delattr", "get_ipython",
    "breakpoint", "input", "exit", "quit", "memoryview", "open_code",
})
NAMES_REFUSED = frozenset({"__builtins__", "__builtin__", "__loader__", "__spec__"})
ATTRIBUTES_REFUSED = frozenset({
    "sys", "builtins", "importlib", "inspect", "gc", "subprocess", "ctypes", "_exit", "kill", "killpg",
    "fork", "forkpty", "system", "popen", "abort", "_getframe", "setrecursionlimit", "ast_transformers",
})
ATTRIBUTE_PREFIXES_REFUSED = ("exec", "spawn", "posix_spawn", "f_", "gi_", "cr_", "ag_", "tb_", "co_")
DUNDERS_ALLOWED = frozenset({"__init__", "__name__", "__qualname__", "__doc__"})
METHODS_ALLOWED = frozenset({"__init__", "__call__", "__repr__", "__str__", "__enter__", "__exit__", "__iter__",
                             "__len__", "__getitem__", "__post_init__"})
"""Dunder methods an answer's class may define; the others change how values compare, hash or convert."""

BUILTIN_VALUE_TYPES = frozenset({"int", "float", "complex", "bool", "str", "bytes", "bytearray", "list", "tuple",
                                 "dict", "set", "frozenset", "type", "object", "super", "property"})
BUILTIN_NAMES = frozenset(dir(builtins))
SELF_NAMES = frozenset({"self", "cls", "ctx"})
REFUSED_CONTEXT_MODULES = ("unittest", "course_lib", "course_tools", "importlib", "inspect", "sys", "builtins")
"""An answer may use a setup name from these only where the reference answer uses it too."""


@dataclass(frozen=True)
class Violation:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def top_level_definitions(tree: ast.Module) -> dict[str, str]:
    """{name: "def" | "class" | "assign" | "import" | ...} for every name the cell binds at its top level."""
    bound: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bound[node.name] = "def"
        elif isinstance(node, ast.ClassDef):
            bound[node.name] = "class"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound[(alias.asname or alias.name).split(".")[0]] = "import"
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    bound.setdefault(sub.id, "assign")
                elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    break
    return bound


def written_methods(tree: ast.Module) -> set[str]:
    """Names of the methods defined in the cell's classes (what the learner writes, e.g. forward)."""
    return {item.name for node in tree.body if isinstance(node, ast.ClassDef) for item in node.body
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))} - {"__init__"}


def attribute_root(node: ast.AST) -> ast.AST:
    """The innermost object of `a.b[c].d`: the Name `a` (or a Call, a Subscript's value ...)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node


def _fingerprints(tree: ast.AST) -> set[str]:
    """What the reference answer does, as comparable strings: each attribute access, call target, import, name."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.add(f"attr:{node.attr}")
            found.add(f"attrof:{ast.unparse(node)}")
        if isinstance(node, ast.Subscript):
            found.add(f"attrof:{ast.unparse(node)}")
        elif isinstance(node, ast.Name):
            found.add(f"name:{node.id}")
        elif isinstance(node, ast.Import):
            found |= {f"import:{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {f"import:{node.module}"} | {f"importname:{alias.name}" for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(f"method:{node.name}")
    return found


def _module_allowed(module: str, reference: set[str]) -> bool:
    if f"import:{module}" in reference:
        return True
    top = module.split(".")[0]
    if any(part.startswith("_") for part in module.split(".")):
        return False
    return module in ALLOWED_MODULES or top in {"torch", "numpy"}


NOT_IN_THE_ANSWER = re.compile(r"^\s*#\s*not in the answer:\s*(.+?)\.?\s*$", re.IGNORECASE | re.MULTILINE)


def declared_refusals(tests: str) -> set[str]:
    """Dotted names a test cell declares off limits: `# Not in the answer: torch.amp.GradScaler, x.y (why)`.

    Each comma-separated item's first word is the name; the rest of it is a comment for the reader.
    """
    return {name.split()[0].strip("`") for line in NOT_IN_THE_ANSWER.findall(tests) for name in line.split(",")
            if name.strip()}


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


class _Auditor(ast.NodeVisitor):
    def __init__(self, reference: set[str], context: dict[str, str], required: set[str], methods: set[str],
                 compared_with: set[str], declared: set[str] = frozenset()):
        self.reference, self.context, self.required, self.methods = reference, context, required, methods
        self.compared_with, self.declared = compared_with, declared
        self.violations: list[Violation] = []
        self.function_stack: list[ast.AST] = []
        self.aliases: set[str] = set()  # names bound to a module or setup object (t = torch.testing)
        self.own_setattr: set[int] = set()  # setattr names of calls visit_Call checked

    def check_declared(self, node: ast.AST) -> bool:
        """Refuse a use of a name the test cell declared off limits; True if refused."""
        name = dotted(node)
        last = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if isinstance(node, ast.Name) and node.id not in self.context and node.id not in self.aliases:
            last = None  # the answer's own variable, whatever its name; an imported name is checked at its import
        for refused in self.declared:
            if (name and (name == refused or name.startswith(refused + "."))) or last == refused.split(".")[-1]:
                self.refuse(node, f"`{name or last}` is what the tests compare your answer with; write the answer "
                                  "without it")
                return True
        return False

    def refuse(self, node: ast.AST, message: str) -> None:
        self.violations.append(Violation(getattr(node, "lineno", 0), message))

    def allowed_by_reference(self, key: str) -> bool:
        return key in self.reference

    # --- calls
    def visit_Call(self, node: ast.Call) -> None:
        """`setattr(obj, name, value)` is module surgery on the answer's own objects (swapping a layer): allowed
        where `obj` is not a module, a setup object or a builtin, which writing `obj.attr = value` would change."""
        func = node.func
        if isinstance(func, ast.Name) and func.id == "setattr" and func.id not in self.context and node.args:
            self.own_setattr.add(id(func))
            target = node.args[0]
            if isinstance(target, ast.Starred) or len(node.args) < 2:
                self.refuse(node, "`setattr` with unpacked arguments: write `setattr(obj, name, value)`")
            else:
                probe = ast.Attribute(value=target, attr="_", ctx=ast.Store(), lineno=node.lineno)
                before = len(self.violations)
                self.check_target(probe, top_level=not self.function_stack)
                for violation in self.violations[before:]:  # say setattr, not the probe's attribute
                    self.violations[self.violations.index(violation)] = Violation(
                        violation.line, f"`{ast.unparse(node)}` changes `{ast.unparse(target)}`, which the tests "
                                        "use; an answer may change only its own objects")
        self.generic_visit(node)

    # --- names the answer reads
    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and id(node) in self.own_setattr:
            pass
        elif isinstance(node.ctx, ast.Load):
            if self.check_declared(node):
                pass
            elif node.id in NAMES_REFUSED:
                self.refuse(node, f"`{node.id}` reaches the interpreter's internals; an answer may not use it")
            elif node.id in CALLS_REFUSED and not self.allowed_by_reference(f"name:{node.id}"):
                self.refuse(node, f"`{node.id}` runs or changes code at run time; write the answer as plain code")
            elif node.id in self.context and not self.allowed_by_reference(f"name:{node.id}"):
                origin = self.context[node.id].removeprefix("module:")
                if origin.startswith(REFUSED_CONTEXT_MODULES):
                    self.refuse(node, f"`{node.id}` comes from {origin}; the exercise asks you to write this "
                                      "yourself, without it")
                elif node.id in self.compared_with and not self.context[node.id].startswith("module:"):
                    self.refuse(node, f"`{node.id}` is what the tests compare your answer with; write the answer "
                                      "without it")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self.check_declared(node):
            return
        name = node.attr
        allowed = self.allowed_by_reference(f"attr:{name}")
        if name.startswith("__") and name.endswith("__") and name not in DUNDERS_ALLOWED and not allowed:
            self.refuse(node, f"`.{name}` reaches an object's internals; an answer may not use dunder attributes")
        elif (name in ATTRIBUTES_REFUSED or name.startswith(ATTRIBUTE_PREFIXES_REFUSED)) and not allowed:
            self.refuse(node, f"`.{name}` reaches the interpreter or the process; an answer may not use it")
        elif isinstance(node.ctx, ast.Load) and (name in self.required or name in self.methods):
            root = attribute_root(node)
            is_self = isinstance(root, ast.Name) and root.id in SELF_NAMES and name not in self.required
            if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super":
                if not self.allowed_by_reference(f"attrof:{ast.unparse(node)}"):
                    self.refuse(node, f"`super().{name}` runs the given implementation; write `{name}` yourself")
            elif not is_self and not self.allowed_by_reference(f"attrof:{ast.unparse(node)}"):
                self.refuse(node, f"`{ast.unparse(node)}` is another implementation of `{name}`, the one you are "
                                  "asked to write")
        self.generic_visit(node)

    # --- what the answer changes
    def check_target(self, target: ast.AST, top_level: bool) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.check_target(element, top_level)
            return
        if isinstance(target, ast.Starred):
            self.check_target(target.value, top_level)
            return
        if isinstance(target, ast.Name):
            if top_level and (target.id in self.context or target.id in BUILTIN_NAMES) \
                    and target.id not in self.required:
                self.refuse(target, f"`{target.id}` is a name of the setup cells or a Python builtin; an answer "
                                    "may not rebind it (choose another name)")
            return
        if isinstance(target, (ast.Attribute, ast.Subscript)):
            chain = target
            while isinstance(chain, (ast.Attribute, ast.Subscript)):
                if isinstance(chain, ast.Attribute) and chain.attr.startswith("__") and chain.attr.endswith("__"):
                    self.refuse(target, f"writing `.{chain.attr}` changes how an object behaves; an answer may not")
                    return
                chain = chain.value
            root = chain
            if isinstance(root, ast.Name) and (root.id in self.context or root.id in BUILTIN_NAMES
                                               or root.id in self.aliases):
                if not self.allowed_by_reference(f"attrof:{ast.unparse(target)}"):
                    self.refuse(target, f"`{ast.unparse(target)}` changes `{root.id}`, which the tests use; an answer "
                                        "may change only its own objects")

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self.check_target(target, top_level=not self.function_stack)
        if self.is_alias(node.value):
            self.aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        self.generic_visit(node)

    def is_alias(self, value: ast.AST) -> bool:
        root = attribute_root(value) if isinstance(value, (ast.Attribute, ast.Name)) else None
        return isinstance(root, ast.Name) and (root.id in self.context or root.id in BUILTIN_NAMES
                                               or root.id in self.aliases) \
            and not isinstance(value, ast.Subscript)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.check_target(node.target, top_level=not self.function_stack)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.check_target(node.target, top_level=not self.function_stack)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self.check_target(target, top_level=not self.function_stack)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self.check_target(node.target, top_level=not self.function_stack)
        self.generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            if item.optional_vars is not None:
                self.check_target(item.optional_vars, top_level=not self.function_stack)
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.check_target(node.target, top_level=True)  # := binds in the enclosing scope, even from a comprehension
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            if name in self.context or name in BUILTIN_NAMES:
                self.refuse(node, f"`global {name}` lets the answer rebind a name the tests use")

    # --- imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not _module_allowed(alias.name, self.reference):
                self.refuse(node, f"`import {alias.name}`: an answer may import only the standard library's plain "
                                  f"modules, torch and numpy ({', '.join(sorted(ALLOWED_MODULES - {'os.path'}))})")
            self.check_target(ast.Name(id=(alias.asname or alias.name).split(".")[0], ctx=ast.Store(),
                                       lineno=node.lineno), top_level=not self.function_stack)
            self.aliases.add((alias.asname or alias.name).split(".")[0])  # `import torch as t`: t is torch

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or not _module_allowed(module, self.reference):
            self.refuse(node, f"`from {module} import ...`: an answer may import only the standard library's plain "
                              "modules, torch and numpy")
        for alias in node.names:
            self.check_declared(ast.Attribute(value=ast.Name(id=module or "_", ctx=ast.Load()), attr=alias.name,
                                              ctx=ast.Load(), lineno=node.lineno))
            if alias.name in self.required and not self.allowed_by_reference(f"importname:{alias.name}"):
                self.refuse(node, f"`from {module} import {alias.name}` imports the implementation you are asked "
                                  "to write")
            self.check_target(ast.Name(id=alias.asname or alias.name, ctx=ast.Store(), lineno=node.lineno),
                              top_level=not self.function_stack)
            self.aliases.add(alias.asname or alias.name)  # a module, or an object of one: not the answer's own

    # --- definitions
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.function_stack.append(node)
        self.generic_visit(node)
        self.function_stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in BUILTIN_VALUE_TYPES - {"object"}:
                self.refuse(base, f"class {node.name} derives from `{base.id}`: an answer's objects may not pose "
                                  "as Python values")
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("__") \
                    and item.name not in METHODS_ALLOWED and not self.allowed_by_reference(f"method:{item.name}"):
                self.refuse(item, f"class {node.name} defines `{item.name}`: an answer may not change how its objects "
                                  "compare, hash or convert")
            elif isinstance(item, ast.Assign) and any(getattr(t, "id", "").startswith("__") for t in item.targets):
                self.refuse(item, f"class {node.name} sets a dunder attribute; an answer may not")
        self.function_stack.append(node)
        self.generic_visit(node)
        self.function_stack.pop()


def audit(answer: str, reference: str, context: dict[str, str] | None = None, tests: str = "") -> list[Violation]:
    """Violations of `answer` (the learner's cell) against `reference` (the solution, markers removed).

    context: where each name of the setup cells comes from, "module:<name>" for a module, else the module
    that defines the object, e.g. {"torch": "module:torch", "library": "module:course_lib.core.model",
    "DistributedSampler": "torch.utils.data.distributed"}. tests: the exercise's test cell; a setup object
    it uses and the reference does not (what the tests compare with) is refused in the answer.
    """
    context = dict(context or {})
    try:
        tree = ast.parse(answer)
    except SyntaxError as error:
        return [Violation(error.lineno or 0, f"SyntaxError: {error.msg}")]
    reference_tree = ast.parse(reference)
    reference_names = top_level_definitions(reference_tree)
    required = {name for name, kind in reference_names.items() if kind in ("def", "class")}
    bound = top_level_definitions(tree)
    violations = [Violation(0, f"`{name}` must be defined in this cell with `{'class' if kind == 'class' else 'def'} "
                               f"{name}`" + (f" (here it is bound by {bound[name]}: write it yourself)"
                                             if name in bound else ""))
                  for name, kind in sorted(reference_names.items())
                  if kind in ("def", "class") and bound.get(name) != kind]
    try:
        test_names = {node.id for node in ast.walk(ast.parse(tests)) if isinstance(node, ast.Name)}
    except SyntaxError:
        test_names = set()
    compared_with = (test_names & set(context)) - {n.id for n in ast.walk(reference_tree) if isinstance(n, ast.Name)}
    auditor = _Auditor(_fingerprints(reference_tree), context, required,
                       written_methods(reference_tree) - set(context), compared_with, declared_refusals(tests))
    auditor.visit(tree)
    return sorted(set(violations + auditor.violations), key=lambda v: (v.line, v.message))
