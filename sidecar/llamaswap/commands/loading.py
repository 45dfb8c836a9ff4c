"""Loading the configuration for a command: warnings go to standard error, and an invalid
configuration prints each problem (its key path and the fix) and exits with EXIT_CONFIG."""

from __future__ import annotations

import sys

from llamaswap.config import Config, ConfigError, load_config
from llamaswap.config.advice import advice

# The exit status of a configuration error (also of a bad command line, as argparse's).
EXIT_CONFIG = 2


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def warn_about(config: Config) -> None:
    """Settings that run but do not do what they seem to, each with its fix."""
    for problem in advice(config):
        warn(str(problem))


def exit_on(exc: ConfigError) -> SystemExit:
    """Print the problems; the SystemExit to raise (`from exc`)."""
    for problem in exc.problems:
        print(f"error: {problem}", file=sys.stderr)
    return SystemExit(EXIT_CONFIG)


def load_or_exit(path: str | None) -> Config:
    try:
        return load_config(path, warn=warn)
    except ConfigError as exc:
        raise exit_on(exc) from exc
