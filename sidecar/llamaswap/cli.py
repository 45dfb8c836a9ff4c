"""The `llamaswap` command: argument parsing, then hand-off to the module that does the work."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import yaml

from llamaswap import __version__
from llamaswap.config import Config, ConfigError, load_config, load_document

EXIT_CONFIG = 2

DESCRIPTION = """\
A priority scheduler for one GPU behind an OpenAI-compatible LLM server. Envoy holds each
request until the scheduler grants the GPU, one at a time, by
score = X-LlamaSwap-Priority + swap affinity + aging.
"""
EPILOG = """\
examples:
  llamaswap up                           Envoy, the sidecar and a small llama-server on this machine
  llamaswap up -c my.yaml                the same with your settings (or your own upstream.url)
  llamaswap queue --watch                the live queue with estimated starts, like squeue --start
  llamaswap simulate --activity act.log  replay recorded traffic under other settings
  llamaswap check-config -c my.yaml      validate a configuration and explain its settings
"""


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def _exit_on(exc: ConfigError) -> SystemExit:
    for problem in exc.problems:
        print(f"error: {problem}", file=sys.stderr)
    return SystemExit(EXIT_CONFIG)


def _load_or_exit(path: str | None) -> Config:
    try:
        return load_config(path, warn=_warn)
    except ConfigError as exc:
        raise _exit_on(exc) from exc


def _check_config(args: argparse.Namespace) -> int:
    from llamaswap.core.explain import explain_policy

    config = _load_or_exit(args.config)
    print("ok")
    for line in explain_policy(config.policy()):
        print(f"  {line}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from llamaswap.serve import serve

    config = _load_or_exit(args.config)
    try:
        return asyncio.run(serve(config, config_path=args.config, ports_file=args.ports_file,
                                 activity_path=args.activity_log, grace_s=args.grace))
    except OSError as exc:
        print(f"error: {exc.strerror if exc.strerror else exc}", file=sys.stderr)
        return 1


def _envoy_config(args: argparse.Namespace) -> int:
    from llamaswap.envoy import build_bootstrap, render_bootstrap

    config = _load_or_exit(args.config)
    bootstrap = build_bootstrap(config, envoy_admin_port=args.admin_port, envoy_admin_host=args.admin_host,
                                otlp_endpoint=args.otlp_endpoint or _otlp_endpoint_from_env(),
                                memory_limit_bytes=args.memory_limit_bytes)
    text = render_bootstrap(bootstrap)
    if args.output:
        tmp = f"{args.output}.tmp"
        with open(tmp, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, args.output)
    else:
        sys.stdout.write(text)
    return 0


def _up(args: argparse.Namespace) -> int:
    import asyncio
    import pathlib

    from llamaswap.stack import StackError, effective_config, ensure_default_model, run_stack

    try:
        document = load_document(args.config) if args.config else {}
        config, built_in = effective_config(document, source=args.config or "<built-in default>", warn=_warn)
        if args.print_config:
            print(f"# the effective configuration of `llamaswap up` ({config.source})")
            sys.stdout.write(yaml.safe_dump(config.to_document(), sort_keys=False))
            return 0
        if built_in:
            ensure_default_model()
    except ConfigError as exc:
        raise _exit_on(exc) from exc
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    workdir = pathlib.Path(args.workdir) if args.workdir else None
    return asyncio.run(run_stack(config, config_path=args.config, workdir=workdir,
                                 otlp_endpoint=_otlp_endpoint_from_env(), grace_s=args.grace,
                                 activity_path=args.activity_log))


def _otlp_endpoint_from_env() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from exc
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaswap", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    parser.add_argument("--version", action="version", version=f"llamaswap {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="run Envoy, the sidecar and the upstream on this machine",
                             description="Run the whole stack on this machine until SIGTERM or Ctrl-C.")
    up.add_argument("-c", "--config", help="YAML configuration file; one that names no upstream (upstream.url or "
                    "upstream.command) keeps the built-in llama-server with a small model")
    up.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    up.add_argument("--workdir", help="keep logs and the generated Envoy bootstrap here (default: a temporary "
                    "directory, removed on a clean stop)")
    up.add_argument("--grace", type=_non_negative_seconds, default=30.0,
                    help="seconds the running request may take to finish when stopping (default 30)")
    up.add_argument("--activity-log", metavar="FILE", help="append the activity log's JSON lines to FILE "
                    "(what `llamaswap simulate --activity` reads; overrides activity.path)")
    up.set_defaults(run=_up)

    serve = commands.add_parser("serve", help="run the sidecar alone (what the Helm chart runs)",
                                description="Run the sidecar: gRPC for Envoy and the admin HTTP server.")
    serve.add_argument("-c", "--config", help="YAML configuration file (defaults apply without one)")
    serve.add_argument("--ports-file", help="write the bound ports as JSON here (useful with port 0)")
    serve.add_argument("--grace", type=_non_negative_seconds, default=30.0,
                       help="seconds the running request may take to finish on SIGTERM (default 30)")
    serve.add_argument("--activity-log", metavar="FILE", help="append the activity log's JSON lines to FILE "
                       "(overrides activity.path)")
    serve.set_defaults(run=_serve)

    envoy_config = commands.add_parser("envoy-config", help="print the Envoy bootstrap for a configuration")
    envoy_config.add_argument("-c", "--config", help="YAML configuration file (defaults apply without one)")
    envoy_config.add_argument("-o", "--output", help="write it to this file instead of standard output")
    envoy_config.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port (default 9901)")
    envoy_config.add_argument("--admin-host", default="127.0.0.1", help="Envoy admin address (default 127.0.0.1)")
    envoy_config.add_argument("--otlp-endpoint", help="OTLP/gRPC endpoint for Envoy's tracer "
                              "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; none disables tracing)")
    envoy_config.add_argument("--memory-limit-bytes", type=int, default=None,
                              help="Envoy's container memory limit: its overload manager's heap budget is a share "
                              "of it (envoy.maxHeapBytes: 0); the Helm chart passes the Envoy container's limit")
    envoy_config.set_defaults(run=_envoy_config)

    check = commands.add_parser("check-config", help="validate a configuration and explain its settings")
    check.add_argument("-c", "--config", required=True, help="YAML configuration file")
    check.set_defaults(run=_check_config)

    from llamaswap import model_preload, models_fetch, queue_cli
    from llamaswap.simulate import cli as simulate_cli

    queue_cli.add_parser(commands)
    simulate_cli.add_parser(commands)
    models_fetch.add_parser(commands)
    model_preload.add_parser(commands)
    return parser


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Activity records are JSON lines that carry their own time: written as they are, one a
    # line, which also spares every request a timestamp formatting.
    from llamaswap.runtime.activity import LOGGER_NAME

    activity = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    activity.addHandler(handler)
    activity.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(str(args.log_level))
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
