"""What is wrong with a configuration, as key-path problems: `Problem`, `ConfigError`, and the
translation of pydantic's validation errors (with did-you-mean for unknown keys).

Nothing here knows the sections: the translation walks whichever root section it is given.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration: its key path and what to do about it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """The configuration is invalid; ``problems`` names each key path and its fix."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def describe_value(value: Any) -> str:
    """A value as the YAML author wrote it: ``a string 'abc'``, ``a list``."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"a boolean {'true' if value else 'false'}"
    if isinstance(value, (int, float)):
        return f"a number {value!r}"
    if isinstance(value, str):
        return f"a string {value!r}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__} {value!r}"


def invalid(message: str, **ctx: Any) -> PydanticCustomError:
    """A validation error whose message is final (``ctx['key']`` extends the key path)."""
    return PydanticCustomError("llamaswap", "{message}", {"message": message, **ctx})


def invalid_all(title: str, problems: Sequence[Problem]) -> ValidationError:
    """Several final problems at once, from a validator of the root section (each its whole key path)."""
    return ValidationError.from_exception_data(title, [
        InitErrorDetails(type=invalid(problem.message, key=problem.path), loc=(), input=None) for problem in problems])


@dataclasses.dataclass(frozen=True)
class Meaning:
    """What a setting's special value means; range errors quote it. (Pydantic ignores it.)"""

    text: str



# -- pydantic's errors -> problems ---------------------------------------------------------


def _llama_swap_keys(section: type[BaseModel]) -> frozenset[str]:
    """The llama-swap keys a section accepts and ignores (see `sections.Section`)."""
    return frozenset(getattr(section, "_llama_swap_keys", frozenset()))


def _deprecated_keys_of(section: type[BaseModel]) -> Mapping[str, str]:
    """The deprecated keys of a section, each with its advice (see `sections.Section`)."""
    deprecated: Mapping[str, str] = getattr(section, "_deprecated_keys", {})
    return deprecated


@dataclasses.dataclass(frozen=True)
class _MappingOf:
    """A mapping key (``models``) whose values are sections."""

    section: type[BaseModel]


@dataclasses.dataclass(frozen=True)
class _ListOf:
    """A list key (``upstreams``) whose items are sections; its key paths say ``upstreams[1]``."""

    section: type[BaseModel]


def _field(section: type[BaseModel], key: Any) -> FieldInfo | None:
    for name, info in section.model_fields.items():
        if key in (info.alias, name):
            return info
    return None


def _unannotated(annotation: Any) -> Any:
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _child(section: type[BaseModel], key: Any) -> type[BaseModel] | _MappingOf | _ListOf | None:
    """What is under ``key`` of a section: a section, a mapping or a list of sections, or a value (None)."""
    info = _field(section, key)
    if info is None:
        return None
    annotation = _unannotated(info.annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # `X | None`: X
        present = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        annotation = _unannotated(present[0]) if len(present) == 1 else annotation
    if _is_section(annotation):
        return typing.cast(type[BaseModel], annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (dict, Mapping) and _is_section(_unannotated(args[1])):
        return _MappingOf(_unannotated(args[1]))
    if origin in (tuple, list) and args and _is_section(_unannotated(args[0])):
        return _ListOf(_unannotated(args[0]))
    return None


def _section_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    node: type[BaseModel] | _MappingOf | _ListOf | None = root
    for part in loc:
        if isinstance(node, (_MappingOf, _ListOf)):
            node = node.section
        elif node is not None:
            node = _child(node, part)
    return node if isinstance(node, type) else None


def _field_at(root: type[BaseModel], loc: tuple[Any, ...]) -> FieldInfo | None:
    section = _section_at(root, loc[:-1]) if loc else None
    return _field(section, loc[-1]) if section is not None else None


def _dotted(loc: tuple[Any, ...], root: type[BaseModel] | None = None) -> str:
    """A location as a key path: ``models.qwen.slots``, ``upstreams[1].url`` (an item of a list
    of sections, found by walking ``root``)."""
    text = ""
    node: type[BaseModel] | _MappingOf | _ListOf | None = root
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(node, _ListOf) and isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
        if isinstance(node, (_MappingOf, _ListOf)):
            node = node.section
        elif node is not None:
            node = _child(node, part)
    return text or "(top level)"


def _unknown_key(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    section = _section_at(root, loc[:-1])
    if section is None:
        return "unknown key"
    known = [info.alias or name for name, info in section.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), known + sorted(_llama_swap_keys(section)), n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean '{close[0]}'?"
    if not known:
        return "unknown key; nothing is allowed here"
    ignored = " (and llama-swap's keys, which are ignored)" if _llama_swap_keys(section) else ""
    return f"unknown key; allowed here: {', '.join(sorted(known))}{ignored}"


def _range(info: FieldInfo | None) -> tuple[str, str]:
    """(the allowed range, what its special value means) of a numeric field."""
    low = high = meaning = ""
    for item in info.metadata if info is not None else ():
        if isinstance(item, Ge):
            low = f"{item.ge!r}"
        elif isinstance(item, Gt):
            low = f"> {item.gt!r}"
        elif isinstance(item, Le):
            high = f"{item.le!r}"
        elif isinstance(item, Lt):
            high = f"< {item.lt!r}"
        elif isinstance(item, Meaning):
            meaning = item.text
    if low and high and not low.startswith(">") and not high.startswith("<"):
        bounds = f"{low}..{high}"
    elif low:
        bounds = low if low.startswith(">") else f">= {low}"
    else:
        bounds = high if high.startswith("<") else f"<= {high}"
    return bounds, meaning


_TYPE_MESSAGES = {
    "int_type": "must be an integer", "int_parsing": "must be an integer", "int_from_float": "must be an integer",
    "float_type": "must be a number", "float_parsing": "must be a number",
    "bool_type": "must be true or false", "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "model_type": "must be a mapping", "model_attributes_type": "must be a mapping", "dict_type": "must be a mapping",
    "list_type": "must be a list", "tuple_type": "must be a list",
}


def problem_of(error: Mapping[str, Any], root: type[BaseModel]) -> Problem:
    """One of pydantic's errors, validating the document of ``root``, as a key-path problem."""
    loc = tuple(error["loc"])
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "llamaswap":
        return Problem(_dotted(loc + ((ctx["key"],) if "key" in ctx else ()), root), str(error["msg"]))
    if kind == "missing":
        message = "is required"
    elif kind == "extra_forbidden":
        message = _unknown_key(root, loc)
    elif kind == "invalid_key":
        message = f"keys must be strings, got {describe_value(loc[-1] if loc else value)}"
    elif kind in _TYPE_MESSAGES:
        message = f"{_TYPE_MESSAGES[kind]}, got {describe_value(value)}"
    elif kind == "finite_number":
        message = f"must be a finite number, got {value!r}"
    elif kind == "enum":
        info = _field_at(root, loc)
        choices = info.annotation if info is not None and isinstance(info.annotation, type) else None
        expected = ", ".join(repr(str(c)) for c in choices) if choices else ctx.get("expected", "")
        got = repr(value) if isinstance(value, str) else describe_value(value)
        message = f"must be one of {expected}, got {got}"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bounds, meaning = _range(_field_at(root, loc))
        message = f"must be {bounds}{f' ({meaning})' if meaning else ''}, got {value!r}"
    elif kind == "sub_millisecond":
        _, meaning = _range(_field_at(root, loc))
        message = (f"must be 0{f' ({meaning})' if meaning else ''} or at least 0.001 seconds, got {value!r}: "
                   "a smaller positive value would round to 0")
    else:
        message = str(error["msg"])
    return Problem(_dotted(loc, root), message)


def deprecated_keys(data: Any, section: type[BaseModel], loc: tuple[Any, ...] = (),
                    root: type[BaseModel] | None = None) -> Iterator[Problem]:
    """The deprecated keys a document uses, each with its advice."""
    if not isinstance(data, dict):
        return
    root = root or section
    for key, value in data.items():
        if key in _deprecated_keys_of(section):
            yield Problem(_dotted(loc + (key,), root), _deprecated_keys_of(section)[key])
            continue
        child = _child(section, key)
        if isinstance(child, _MappingOf) and isinstance(value, dict):
            for item_key, item in value.items():
                yield from deprecated_keys(item, child.section, loc + (key, item_key), root)
        elif isinstance(child, _ListOf) and isinstance(value, list):
            for index, item in enumerate(value):
                yield from deprecated_keys(item, child.section, loc + (key, index), root)
        elif isinstance(child, type):
            yield from deprecated_keys(value, child, loc + (key,), root)
