"""The core stays pure: no I/O, no asyncio, no gRPC or OpenTelemetry, nothing from the edges;
no layer imports one above it (the commands sit on top, the core at the bottom); and no module
imports itself back through others (no import circles).

Checked on the source (every import statement of every module), so a lazy import inside a
function is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import pathlib

import llamaswap.core

CORE = pathlib.Path(llamaswap.core.__file__).parent
PACKAGE = CORE.parent
FORBIDDEN = ("llamaswap.runtime", "llamaswap.adapters", "llamaswap.telemetry", "llamaswap.config",
             "llamaswap.commands", "llamaswap.envoy", "llamaswap.simulate", "llamaswap.batches",
             "grpc", "asyncio", "opentelemetry", "aiohttp", "socket", "subprocess", "threading", "yaml", "pydantic")


def imported_modules(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_core_imports_nothing_from_the_edges():
    modules = sorted(CORE.glob("*.py"))
    assert len(modules) >= 5  # the glob found the package
    offending = {}
    for path in modules:
        bad = [name for name in imported_modules(path)
               if any(name == forbidden or name.startswith(forbidden + ".") for forbidden in FORBIDDEN)]
        if bad:
            offending[path.name] = bad
    assert offending == {}


def test_the_rule_catches_a_forbidden_import(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f():\n    import asyncio.tasks\n    from opentelemetry import trace\n")
    assert imported_modules(sneaky) == ["asyncio.tasks", "opentelemetry"]


# What each layer may import of llamaswap (besides the package itself, for its version). The
# commands may import anything; nothing imports them. The adapters and the batches import Envoy's
# contract, never the bootstrap builder or the binary. The batches (the Batch API) sit beside the
# runtime, not on it: their lines reach the coordinator through Envoy's listener, like a client's
# requests; telemetry observes both (the feeder's observer port, as the runtime's).
ALLOWED = {
    "core": {"llamaswap.core"},
    "config": {"llamaswap.core", "llamaswap.config"},
    "envoy": {"llamaswap.core", "llamaswap.config", "llamaswap.envoy"},
    "runtime": {"llamaswap.core", "llamaswap.config", "llamaswap.runtime"},
    "batches": {"llamaswap.core", "llamaswap.config", "llamaswap.envoy.contract", "llamaswap.batches"},
    "telemetry": {"llamaswap.core", "llamaswap.runtime", "llamaswap.batches", "llamaswap.telemetry"},
    "simulate": {"llamaswap.core", "llamaswap.config", "llamaswap.simulate"},
    "adapters": {"llamaswap.core", "llamaswap.config", "llamaswap.runtime", "llamaswap.envoy.contract",
                 "llamaswap.adapters", "llamaswap._proto"},
}


def upward_imports(layer: str, names: list[str]) -> list[str]:
    allowed = ALLOWED[layer]
    return [name for name in names if name.startswith("llamaswap.")
            and not any(name == ok or name.startswith(ok + ".") for ok in allowed)]


def test_no_layer_imports_one_above_it():
    layers = sorted(path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists())
    assert set(layers) == {*ALLOWED, "commands", "_proto"}  # a new package needs its rule here
    offending = {}
    for layer in ALLOWED:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            bad = upward_imports(layer, imported_modules(path))
            if bad:
                offending[str(path.relative_to(PACKAGE))] = bad
    assert offending == {}


# The Batch API's pure modules (their docstrings say so): values in, values out, no I/O.
PURE_BATCH_MODULES = ("lifecycle.py", "validate.py")
IO = ("asyncio", "aiohttp", "sqlite3", "socket", "subprocess", "threading", "grpc", "opentelemetry", "os",
      "pathlib")


def test_the_batches_pure_modules_do_no_io():
    offending = {}
    for name in PURE_BATCH_MODULES:
        path = PACKAGE / "batches" / name
        bad = [module for module in imported_modules(path)
               if any(module == io or module.startswith(io + ".") for io in IO)]
        if bad:
            offending[name] = bad
    assert offending == {}


def test_the_layer_rule_catches_an_upward_import(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("from llamaswap.envoy.bootstrap import build_bootstrap\n"
                      "from llamaswap.envoy.contract import TICKET_KEY\n"
                      "def f():\n    from llamaswap.commands.main import main\n")
    assert upward_imports("adapters", imported_modules(sneaky)) == ["llamaswap.envoy.bootstrap",
                                                                    "llamaswap.commands.main"]


# No import circles among llamaswap's modules: each depends on what is below it, so one can be read
# (and changed) without the other. An import inside a function or under TYPE_CHECKING counts: it
# only hides the circle. `from a import b` where b is a module is an edge to a.b; a package's
# __init__ that a submodule's import runs on the way is not (it is no dependency of the importer).
def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module under the package directory ``root``, by its dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_edges(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` (at ``path``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*above, *([base] if base else [])])
            targets.extend(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names)
    edges = set()
    for target in targets:
        while target and target not in known:  # `import a.b.c` of a name inside a.b: a.b
            target = target.rpartition(".")[0]
        if target:
            edges.add(target)
    return edges


def import_cycles(root: pathlib.Path) -> list[list[str]]:
    """The circles among the modules under ``root``: each strongly connected set of two or more
    modules (or one that imports itself), sorted (Tarjan's algorithm)."""
    modules = module_names(root)
    graph = {name: sorted(import_edges(name, path, set(modules))) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in on_stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == name:
                    break
            if len(component) > 1 or name in graph[name]:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(cycles)


def test_no_import_cycles():
    assert len(module_names(PACKAGE)) >= 50  # the walk found the package
    assert import_cycles(PACKAGE) == []


def test_the_cycle_rule_catches_a_lazy_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.low import VALUE\n")
    (package / "sub" / "low.py").write_text("VALUE = 1\n")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    (package / "d.py").write_text("from .sub import low\nfrom .sub import VALUE\nimport pkg.sub.low.VALUE\n")
    assert import_cycles(package) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert import_edges("pkg.d", package / "d.py", set(module_names(package))) == {"pkg.sub", "pkg.sub.low"}
