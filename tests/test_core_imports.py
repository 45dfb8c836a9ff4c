"""The core stays pure: no I/O, no asyncio, no gRPC or OpenTelemetry, nothing from the edges;
and no layer imports one above it (the commands sit on top, the core at the bottom).

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
    sneaky.write_text("from llamaswap.envoy.bootstrap import build_bootstrap\nfrom llamaswap.envoy.contract import TICKET_KEY\n"
                      "def f():\n    from llamaswap.commands.main import main\n")
    assert upward_imports("adapters", imported_modules(sneaky)) == ["llamaswap.envoy.bootstrap",
                                                                    "llamaswap.commands.main"]

