"""The `llamaswap` command: argument parsing, then hand-off to the module that does the work."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from llamaswap.config import Config, ConfigError, load_config

EXIT_CONFIG = 2


def _load_or_exit(path: str | None) -> Config:
    try:
        return load_config(path, warn=lambda text: print(f"warning: {text}", file=sys.stderr))
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from exc


def _check_config(args: argparse.Namespace) -> int:
    _load_or_exit(args.config)
    print("ok")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaswap", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser("check-config", help="validate a configuration file")
    check.add_argument("-c", "--config", required=True, help="YAML configuration file")
    check.set_defaults(run=_check_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
