"""The layering contract (issue #27), checked on the source with `ast`: no new dependency, nothing imported.

Rules, each named in the failure message:

- ``model-base``: ``scratchlm/model/`` is the bottom of the stack. It imports from scratchlm only the modules in
  ``MODEL_MAY_IMPORT`` (below, each with its reason); never inference, server, training, parallel, ...
- ``model-closure``: the same, transitively: whatever the modules it may import pull in (at any depth) must be
  allowed too, so a utility module cannot smuggle an upward dependency into the model.
- ``no-parallel``: ``scratchlm/inference/`` and ``scratchlm/server/`` never import ``scratchlm.parallel`` (the
  multi-process executor plugs in from above, through ``scratchlm.MULTIPROCESS_EXECUTOR``).
- ``private-import``: no ``_private`` name (or ``_private`` module) is imported from another package; a package is
  a top-level entry of scratchlm (``scratchlm.inference``, ``scratchlm.server``, ``scratchlm.atomic``, ...).
- ``private-attr``: nor reached as ``module._name`` (or ``getattr(module, "_name")``) through a module bound by an
  import in the same file.

Every import counts: module level or inside functions, absolute or relative, and
``importlib.import_module("scratchlm...")`` / ``__import__`` with a literal (or f-string with a literal prefix).
Violations that exist are listed in ``KNOWN_VIOLATIONS`` with a comment each: the test fails on a new one and on a
listed one that is gone, so the list can only shrink.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "scratchlm"

# What scratchlm/model/ may import from scratchlm (prefix match on the module path), and why.
MODEL_MAY_IMPORT = {
    "scratchlm.model": "itself",
    "scratchlm.tokenizer": "checkpoint loaders (GGUF, HF dirs, llama2.c) return the tokenizer stored beside the"
                           " weights; a sibling base layer that imports nothing above it",
    "scratchlm.atomic": "crash-safe file writes (checkpoints, exports): a leaf utility",
    "scratchlm.threads": "CPU thread-count helpers: a leaf utility",
    "scratchlm.config": "typed dataclass configs / CLI flags: a leaf utility",
}
# The root package itself (`import scratchlm`, `from scratchlm import __version__`; not its subpackages, which are
# matched above) holds constants only and imports nothing: allowed, and model-closure keeps it that way.
ROOT_PACKAGE = "scratchlm"

NO_PARALLEL_IN = ("scratchlm.inference", "scratchlm.server")
PARALLEL = "scratchlm.parallel"

# (rule, file relative to the repository, what) -> why it is tolerated for now. Keep each entry commented.
KNOWN_VIOLATIONS: dict[tuple[str, str, str], str] = {
}


@dataclass(frozen=True)
class Violation:
    rule: str
    path: str
    line: int
    what: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.rule, self.path, self.what)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.what}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def source_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_module(name: str) -> bool:
    return name in source_files()


def package_of(module: str) -> str:
    """The top-level entry of scratchlm a module belongs to ("scratchlm" for the root package)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the scratchlm module imported (the deepest one that exists in the tree)
    name: str | None  # the non-module name taken from it (`from m import name`), if any
    dotted: str  # what the source names, for messages


def resolve(target: str) -> tuple[str, list[str]]:
    """Split a dotted target into the deepest existing module and the attribute path after it."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        if is_module(".".join(parts[:cut])):
            return ".".join(parts[:cut]), parts[cut:]
    return target, []


def literal_prefix(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        prefix = str(node.values[0].value)
        return prefix.rsplit(".", 1)[0] if "." in prefix else None  # f"scratchlm.tokenizer.{m}" -> scratchlm.tokenizer
    return None


@cache
def parse(module: str) -> ast.Module:
    path = source_files()[module]
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    path = source_files()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(parse(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "scratchlm":
                    mod, rest = resolve(alias.name)
                    found.append(Import(node.lineno, mod, ".".join(rest) or None, alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "scratchlm":
                continue
            for alias in node.names:
                if alias.name == "*":
                    found.append(Import(node.lineno, resolve(source)[0], None, f"{source}.*"))
                    continue
                full = f"{source}.{alias.name}"
                mod, rest = resolve(full)
                found.append(Import(node.lineno, mod, ".".join(rest) or None, full))
        elif isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))):
            target = literal_prefix(node.args[0])
            if target and target.split(".")[0] == "scratchlm":
                mod, rest = resolve(target)
                found.append(Import(node.lineno, mod, ".".join(rest) or None, f"import_module({target!r})"))
    return tuple(found)


def rel(module: str) -> str:
    return source_files()[module].relative_to(ROOT).as_posix()


def model_allows(module: str) -> bool:
    return module == ROOT_PACKAGE or any(module == p or module.startswith(p + ".") for p in MODEL_MAY_IMPORT)


def check_model_base() -> list[Violation]:
    out = []
    for module in source_files():
        if package_of(module) != "scratchlm.model":
            continue
        for imp in imports_of(module):
            if model_allows(imp.module):
                continue
            out.append(Violation("model-base", rel(module), imp.line, f"imports {imp.dotted}"))
    return out


def check_model_closure() -> list[Violation]:
    """Walk the imports out of the allowed non-model modules: everything reached must be allowed as well."""
    out, seen = [], set()
    todo = [m for m in source_files() if model_allows(m) and package_of(m) != "scratchlm.model"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for imp in imports_of(module):
            if model_allows(imp.module):
                todo.append(imp.module)
            else:
                out.append(Violation("model-closure", rel(module), imp.line,
                                     f"imports {imp.dotted}, which scratchlm/model/ may not depend on"))
    return out


def check_no_parallel() -> list[Violation]:
    out = []
    for module in source_files():
        if not module.startswith(NO_PARALLEL_IN):
            continue
        for imp in imports_of(module):
            if imp.module == PARALLEL or imp.module.startswith(PARALLEL + "."):
                out.append(Violation("no-parallel", rel(module), imp.line, f"imports {imp.dotted}"))
    return out


def check_private_imports() -> list[Violation]:
    out = []
    for module in source_files():
        here = package_of(module)
        for imp in imports_of(module):
            if package_of(imp.module) == here:
                continue
            names = imp.module.split(".")[2:] + (imp.name.split(".") if imp.name else [])
            private = [n for n in names if is_private(n)]
            if private:
                out.append(Violation("private-import", rel(module), imp.line,
                                     f"imports {imp.dotted} ({private[0]} is private to {package_of(imp.module)})"))
    return out


def module_bindings(module: str) -> dict[str, str]:
    """Names an import binds to a scratchlm module in this file: `import a.b` binds a, `import a.b as m` and
    `from a import b` (b a module) bind m / b."""
    bound: dict[str, str] = {}
    for node in ast.walk(parse(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "scratchlm":
                    continue
                if alias.asname:
                    mod, rest = resolve(alias.name)
                    if not rest:
                        bound[alias.asname] = mod
                else:
                    bound[alias.name.split(".")[0]] = "scratchlm"
        elif isinstance(node, ast.ImportFrom):
            for imp in imports_of(module):
                if imp.line == node.lineno and imp.name is None:
                    for alias in node.names:
                        if imp.dotted.endswith("." + alias.name):
                            bound[alias.asname or alias.name] = imp.module
    return bound


def attribute_chain(node: ast.AST) -> list[str] | None:
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(chain)]
    return None


def check_private_attributes() -> list[Violation]:
    out = []
    for module in source_files():
        here = package_of(module)
        bound = module_bindings(module)
        if not bound:
            continue
        for node in ast.walk(parse(module)):
            chain = None
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Del):
                chain = attribute_chain(node)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                base = attribute_chain(node.args[0])
                chain = [*base, node.args[1].value] if base else None
            if not chain or chain[0] not in bound:
                continue
            # walk down the modules the chain names; the first non-module attribute is what is reached
            owner = bound[chain[0]]
            for i, attr in enumerate(chain[1:], start=1):
                if is_module(f"{owner}.{attr}"):
                    owner = f"{owner}.{attr}"
                    continue
                if is_private(attr) and package_of(owner) != here:
                    out.append(Violation("private-attr", rel(module), node.lineno,
                                         f"reads {owner}.{attr} ({'.'.join(chain[:i + 1])})"))
                break
    # an Attribute inside a getattr chain is seen twice; keep one per place
    return sorted(set(out), key=lambda v: (v.path, v.line, v.what))


def all_violations() -> list[Violation]:
    return [*check_model_base(), *check_model_closure(), *check_no_parallel(), *check_private_imports(),
            *check_private_attributes()]


# ---------------------------------------------------------------------------------------------------- tests
def test_the_scanner_sees_the_tree():
    files = source_files()
    assert "scratchlm.model" in files and "scratchlm.inference.engine" in files and len(files) > 50
    engine = {imp.module for imp in imports_of("scratchlm.inference.engine")}
    assert any(m.startswith("scratchlm.model") for m in engine)
    # relative, in-function and importlib imports are resolved
    assert "scratchlm.autodiff.ops" in {imp.module for imp in imports_of("scratchlm.autodiff.graph")}
    assert "scratchlm.tokenizer" in {imp.module for imp in imports_of("scratchlm.model.loading.common")}
    assert "scratchlm.atomic" in {imp.module for imp in imports_of("scratchlm.tokenizer.formats")}


def test_allowed_model_imports_exist():
    for prefix in MODEL_MAY_IMPORT:
        assert is_module(prefix), f"MODEL_MAY_IMPORT names {prefix}, which is not in the tree"


def test_layering_contract():
    found = {v.key: v for v in all_violations()}
    new = [found[k] for k in sorted(set(found) - set(KNOWN_VIOLATIONS))]
    gone = sorted(set(KNOWN_VIOLATIONS) - set(found))
    message = []
    if new:
        message.append("new layering violations (fix them; see this file's docstring for the rules):")
        message += [f"  {v}" for v in new]
    if gone:
        message.append("fixed, so remove from KNOWN_VIOLATIONS in tests/test_layering.py:")
        message += [f"  [{rule}] {path}: {what}" for rule, path, what in gone]
    for v in found.values():  # the known ones, for the log
        if v.key in KNOWN_VIOLATIONS:
            print(f"known: {v}  # {KNOWN_VIOLATIONS[v.key]}")
    assert not message, "\n".join(message)


def test_rules_catch_what_they_should(tmp_path, monkeypatch):
    """The checks themselves, on a throwaway tree: each rule fires once on a planted violation."""
    import sys

    tree = tmp_path / "scratchlm"
    files = {
        "__init__.py": "",
        "atomic.py": "",
        "model/__init__.py": "",
        "model/bad.py": "from ..inference import engine\n"
                        "def f():\n    import scratchlm.server.app\n",
        "model/ok.py": "import scratchlm\nfrom scratchlm import atomic, __version__\nfrom . import bad\n",
        "tokenizer/__init__.py": "from scratchlm.training import loop\n",
        "training/__init__.py": "", "training/loop.py": "",
        "inference/__init__.py": "", "inference/engine.py": "_HIDDEN = 1\ndef _helper(): pass\n",
        "server/__init__.py": "",
        "server/app.py": "import importlib\nfrom scratchlm.inference.engine import _helper\n"
                         "from scratchlm.inference import engine as eng\n"
                         "x = eng._HIDDEN\ny = getattr(eng, '_HIDDEN')\n"
                         "def g():\n    importlib.import_module(f'scratchlm.parallel.{1}')\n",
        "parallel/__init__.py": "",
    }
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "PACKAGE", tree)
    for f in (source_files, parse, imports_of):
        f.cache_clear()
    try:
        got = sorted(str(v) for v in all_violations())
    finally:
        for f in (source_files, parse, imports_of):
            f.cache_clear()
    assert got == [
        "scratchlm/model/bad.py:1: [model-base] imports scratchlm.inference.engine",
        "scratchlm/model/bad.py:3: [model-base] imports scratchlm.server.app",
        "scratchlm/server/app.py:2: [private-import] imports scratchlm.inference.engine._helper "
        "(_helper is private to scratchlm.inference)",
        "scratchlm/server/app.py:4: [private-attr] reads scratchlm.inference.engine._HIDDEN (eng._HIDDEN)",
        "scratchlm/server/app.py:5: [private-attr] reads scratchlm.inference.engine._HIDDEN (eng._HIDDEN)",
        "scratchlm/server/app.py:7: [no-parallel] imports import_module('scratchlm.parallel')",
        "scratchlm/tokenizer/__init__.py:1: [model-closure] imports scratchlm.training.loop, "
        "which scratchlm/model/ may not depend on",
    ]
