"""The core stays pure: no I/O, no asyncio, no gRPC or OpenTelemetry, nothing from the edges.

Checked on the source (every import statement of every module under core/), so a lazy import
inside a function is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import pathlib

import llamaswap.core

CORE = pathlib.Path(llamaswap.core.__file__).parent
FORBIDDEN = ("llamaswap.runtime", "llamaswap.adapters", "llamaswap.telemetry", "llamaswap.config",
             "llamaswap.commands.serve", "llamaswap.commands.up", "llamaswap.envoy", "llamaswap.adapters.upstream_http", "llamaswap.simulate",
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
