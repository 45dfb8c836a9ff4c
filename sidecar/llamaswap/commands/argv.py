"""Command lines of the servers `up` starts: a flag's value set in an argv."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def with_flag_value(argv: Sequence[str], flags: Collection[str], value: str) -> tuple[list[str], bool]:
    """``argv`` with the value of each of ``flags`` (``--flag V`` or ``--flag=V``) set to
    ``value``, and whether any was there (a trailing flag without its value gets it)."""
    result: list[str] = []
    found = False
    skip = False
    prefixes = tuple(f"{flag}=" for flag in flags)
    for argument in argv:
        if skip:
            result.append(value)
            skip = False
        elif argument in flags:
            result.append(argument)
            skip = found = True
        elif argument.startswith(prefixes):
            result.append(f"{argument.split('=', 1)[0]}={value}")
            found = True
        else:
            result.append(argument)
    if skip:
        result.append(value)
    return result, found
