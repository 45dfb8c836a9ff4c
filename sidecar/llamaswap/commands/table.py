"""A plain-text table for the commands that print one (`queue`, `batches`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def table_lines(columns: Sequence[str], rows: Sequence[Sequence[str]], *, right: Collection[str] = ()) -> list[str]:
    """The header and each row, columns as wide as their widest cell, those named in ``right``
    aligned right (numbers), trailing blanks dropped."""
    table = [tuple(columns), *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return ["  ".join(cell.rjust(width) if columns[i] in right else cell.ljust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in table]
