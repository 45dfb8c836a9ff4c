"""No module of the sidecar over 600 lines (issues 26 and 36): a module that grows past it does more
than one job, and its jobs want rooms of their own. The generated protobuf code is not ours."""

from __future__ import annotations

import pathlib

import llamaswap

PACKAGE = pathlib.Path(llamaswap.__file__).parent
MAX_LINES = 600
GENERATED = PACKAGE / "_proto"


def long_modules(root: pathlib.Path, limit: int) -> dict[str, int]:
    """Every Python module under `root` (the generated code aside) longer than `limit` lines."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(GENERATED):
            continue
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found[str(path.relative_to(root))] = lines
    return found


def test_no_module_over_600_lines():
    assert len(list(PACKAGE.rglob("*.py"))) > 20  # the glob found the package
    assert long_modules(PACKAGE, MAX_LINES) == {}


def test_the_rule_catches_a_long_module(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path, MAX_LINES) == {"long.py": MAX_LINES + 1}
