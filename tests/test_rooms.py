"""docs/architecture.md's "The rooms" gives every module of the sidecar its one job in a line:
each module is named there, and each name there is a module (issue 45, item 8). A module added
without its line, or one removed or renamed with its line left behind, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import llamaswap

PACKAGE = Path(llamaswap.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
# Not rooms of their own: the package markers (they gather their package's names), the entry
# point and the generated protobuf code.
NOT_ROOMS = {"__init__.py", "__main__.py"}
ROOM_SUFFIXES = (".py", ".js", ".html", ".css")


def modules(root: Path) -> set[str]:
    """Every module of the package, as `package/module.py` (the page's files among them)."""
    found = set()
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if path.suffix in ROOM_SUFFIXES and path.name not in NOT_ROOMS and relative.parts[0] != "_proto":
            found.add(relative.as_posix())
    return found


def named_in_rooms(text: str) -> set[str]:
    """The modules the rooms table's first column names (one or several per row)."""
    start = text.index("\n## The rooms\n")
    end = text.find("\n## ", start + 1)
    names = set()
    for line in text[start:end].splitlines():
        cells = line.split("|")
        if len(cells) > 2 and line.startswith("| `"):
            names.update(re.findall(r"`([a-z_]+/[a-z_0-9]+\.[a-z]+)`", cells[1]))
    return names


def test_every_module_has_its_line_and_every_line_a_module():
    named = named_in_rooms(ARCHITECTURE.read_text(encoding="utf-8"))
    present = modules(PACKAGE)
    assert len(present) > 100  # the walk found the package
    assert sorted(present - named) == []  # modules with no line of their own
    assert sorted(named - present) == []  # lines for modules that are not there


def test_the_check_sees_a_missing_line(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.py").write_text("")
    (tmp_path / "core" / "b.py").write_text("")
    (tmp_path / "core" / "__init__.py").write_text("")
    text = "\n## The rooms\n\n| module | its one job |\n|---|---|\n| `core/a.py`, `core/c.py` | a |\n\n## Next\n"
    assert modules(tmp_path) - named_in_rooms(text) == {"core/b.py"}
    assert named_in_rooms(text) - modules(tmp_path) == {"core/c.py"}
