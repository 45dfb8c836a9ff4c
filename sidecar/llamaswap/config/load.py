"""Loading a configuration: a YAML file or a parsed document -> a validated `Config`.
Every problem is reported at once, each naming its key path; deprecated keys are warned about."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from typing import Any

import yaml
from pydantic import ValidationError

from llamaswap.config.problems import ConfigError, Problem, deprecated_keys, problem_of
from llamaswap.config.sections import Config

_log = logging.getLogger(__name__)


def _log_warning(text: str) -> None:
    _log.warning("%s", text)


def parse_config(data: Any, *, source: str = "<memory>", warn: Callable[[str], None] | None = None) -> Config:
    """Validate a parsed YAML document. Raises ConfigError listing every problem."""
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([problem_of(error, Config) for error in exc.errors(include_url=False)]) from None
    config._source = source
    for problem in deprecated_keys(data, Config):
        (warn or _log_warning)(str(problem))
    return config


def load_document(path: str | pathlib.Path) -> Any:
    """Read and YAML-parse a file, without validating it. Raises ConfigError naming the file."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([Problem(str(path), f"cannot read the file: {exc.strerror or exc}")]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(str(path), f"is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                                              f"at offset {exc.start})")]) from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem(str(path), f"is not valid YAML{where}: {reason}")]) from exc


def load_config(path: str | pathlib.Path | None, *, warn: Callable[[str], None] | None = None) -> Config:
    """Read and validate a YAML file; ``None`` gives the defaults."""
    if path is None:
        return Config()
    return parse_config(load_document(path), source=str(path), warn=warn)
