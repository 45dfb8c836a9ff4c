"""The `llamaswap` command: argument parsing, then hand-off to the module that does the work."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from llamaswap import __version__
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


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from llamaswap.serve import serve

    config = _load_or_exit(args.config)
    try:
        return asyncio.run(serve(config, config_path=args.config, ports_file=args.ports_file, grace_s=args.grace))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _envoy_config(args: argparse.Namespace) -> int:
    from llamaswap.envoy import build_bootstrap, render_bootstrap

    config = _load_or_exit(args.config)
    bootstrap = build_bootstrap(config, envoy_admin_port=args.admin_port,
                                otlp_endpoint=args.otlp_endpoint or _otlp_endpoint_from_env())
    sys.stdout.write(render_bootstrap(bootstrap))
    return 0


def _up(args: argparse.Namespace) -> int:
    import asyncio
    import pathlib

    from llamaswap.stack import StackError, default_config, run_stack

    if args.config:
        config = _load_or_exit(args.config)
    else:
        try:
            config = default_config()
        except StackError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_CONFIG
    workdir = pathlib.Path(args.workdir) if args.workdir else None
    return asyncio.run(run_stack(config, config_path=args.config, workdir=workdir,
                                 otlp_endpoint=_otlp_endpoint_from_env(), grace_s=args.grace))


def _otlp_endpoint_from_env() -> str | None:
    import os

    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaswap", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--version", action="version", version=f"llamaswap {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser("check-config", help="validate a configuration file")
    check.add_argument("-c", "--config", required=True, help="YAML configuration file")
    check.set_defaults(run=_check_config)

    serve = commands.add_parser("serve", help="run the sidecar (gRPC for Envoy, admin HTTP)")
    serve.add_argument("-c", "--config", help="YAML configuration file (defaults apply without one)")
    serve.add_argument("--ports-file", help="write the bound ports as JSON here (useful with port 0)")
    serve.add_argument("--grace", type=float, default=30.0,
                       help="seconds the running request may take to finish on SIGTERM (default 30)")
    serve.set_defaults(run=_serve)

    up = commands.add_parser("up", help="run Envoy, the sidecar and the upstream on this machine")
    up.add_argument("-c", "--config", help="YAML configuration file; without one, a built-in llama-server "
                    "with a small model")
    up.add_argument("--workdir", help="where logs and the generated Envoy bootstrap go (default: a temp dir)")
    up.add_argument("--grace", type=float, default=30.0,
                    help="seconds the running request may take to finish on Ctrl-C (default 30)")
    up.set_defaults(run=_up)

    envoy_config = commands.add_parser("envoy-config", help="print the Envoy bootstrap for a configuration")
    envoy_config.add_argument("-c", "--config", help="YAML configuration file (defaults apply without one)")
    envoy_config.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port (default 9901)")
    envoy_config.add_argument("--otlp-endpoint", help="OTLP/gRPC endpoint for Envoy's tracer "
                              "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; none disables tracing)")
    envoy_config.set_defaults(run=_envoy_config)

    from llamaswap import queue_cli

    queue_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
