"""The `llamaswap` command: argument parsing, then hand-off to the module that does the work."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import yaml

from llamaswap import __version__
from llamaswap.commands.arguments import add_stop_options
from llamaswap.batches.store import StoreError
from llamaswap.commands.loading import EXIT_CONFIG, exit_on, load_or_exit, warn, warn_about
from llamaswap.config import Config, ConfigError, load_document
from llamaswap.envoy.bootstrap import ENVOY_ADMIN_HOST, ENVOY_ADMIN_PORT

if TYPE_CHECKING:
    from asyncio import AbstractEventLoop

# The levels --log-level accepts (logging's names).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

DESCRIPTION = """\
A priority scheduler for one GPU behind an OpenAI-compatible LLM server. Envoy holds each
request until the scheduler grants the GPU, by
score = X-LlamaSwap-Priority + swap affinity + aging; one grant at a time, or up to
upstream.slots of the loaded model (llama-server's --parallel).
"""
EPILOG = """\
examples:
  llamaswap up                           Envoy, the sidecar and a small llama-server on this machine
  llamaswap up -c my.yaml                the same with your settings (or your own upstream.url)
  llamaswap up --gpus 2                  two llama-servers, one per GPU, behind the one queue
  llamaswap up --max-loaded 3            keep up to 3 models loaded at once (llama-server --models-max 3)
  llamaswap up --idle-unload 600         unload a model idle for 10 minutes (give its memory back)
  llamaswap queue --watch                the live queue with estimated starts, like squeue --start
  llamaswap batches                      the Batch API's batches: progress, estimated finish, priority
  llamaswap simulate --activity-log act.log  replay recorded traffic under other settings
  llamaswap check-config -c my.yaml      validate a configuration and explain its settings
"""


def _check_config(args: argparse.Namespace) -> int:
    """Validate a file as `up` would run it (with the built-in upstream when it names none),
    explain its policy, and check the generated bootstrap with `envoy --mode validate`."""
    from llamaswap.commands.up import StackError, effective_config, names_an_upstream
    from llamaswap.config.idle import describe_idle
    from llamaswap.config.residency import describe_residency
    from llamaswap.core.explain import explain_policy

    try:
        document = load_document(args.config)
        notes = []
        if names_an_upstream(document):
            config, _ = effective_config(document, source=args.config, warn=warn)
        else:
            try:
                config, _ = effective_config(document, source=args.config, warn=warn)
                notes.append("upstream: none named, so the built-in llama-server applies, as `llamaswap up` runs it")
            except StackError as exc:
                config = load_or_exit(args.config)
                notes.append(f"upstream: none named, and `llamaswap up` could not add the built-in one: {exc}")
        config.upstream.read_api_key()  # named but unreadable: what `up` and `serve` would refuse
    except ConfigError as exc:
        raise exit_on(exc) from exc
    envoy_line, envoy_error = _validate_with_envoy(config)
    if envoy_error is not None:
        print(f"error: {envoy_error}", file=sys.stderr)
        return EXIT_CONFIG
    warn_about(config)
    print("ok")
    for line in [*notes, envoy_line, *explain_policy(config.policy()), *describe_residency(config),
                 *describe_idle(config)]:
        print(f"  {line}")
    return 0


def _validate_with_envoy(config: Config) -> tuple[str, str | None]:
    """(what to say, an error or None): the bootstrap checked by `envoy --mode validate`, if Envoy
    is installed."""
    import tempfile

    from llamaswap.envoy.binary import EnvoyNotInstalled, envoy_binary, validate_bootstrap
    from llamaswap.envoy.bootstrap import build_bootstrap, render_bootstrap

    try:
        binary = envoy_binary()
    except EnvoyNotInstalled:
        return "envoy: not installed, so the generated bootstrap was not validated (the envoy extra has it)", None
    with tempfile.TemporaryDirectory(prefix="llamaswap-check-") as workdir:
        path = f"{workdir}/envoy.yaml"
        with open(path, "w", encoding="utf-8") as file:
            file.write(render_bootstrap(build_bootstrap(config, otlp_endpoint=_otlp_endpoint_from_env())))
        done = validate_bootstrap(path)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        return "", f"`envoy --mode validate` refused the generated bootstrap: {' '.join(detail[-3:])}"
    return f"envoy: the generated bootstrap passes `envoy --mode validate` ({binary})", None


def _serve(args: argparse.Namespace) -> int:
    from llamaswap.commands.event_loop import run
    from llamaswap.commands.serve import serve

    config = load_or_exit(args.config)
    try:
        config.upstream.read_api_key()  # unreadable: exit 2 before anything starts
        config.batches.read_keys(None)  # likewise the Batch API's callers' keys
    except ConfigError as exc:
        raise exit_on(exc) from exc
    factory = _loop_factory_or_exit()
    try:
        return run(serve(config, config_path=args.config, ports_file=args.ports_file,
                         activity_path=args.activity_log, grace_s=args.grace), factory)
    except StoreError as exc:  # batches.dir cannot be used: a configuration error
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"error: {exc.strerror if exc.strerror else exc}", file=sys.stderr)
        return 1


def _envoy_config(args: argparse.Namespace) -> int:
    from llamaswap.envoy.bootstrap import build_bootstrap, render_bootstrap

    config = load_or_exit(args.config)
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
    import pathlib

    from llamaswap.commands.event_loop import run
    from llamaswap.commands.up import StackError, effective_config, ensure_default_model, run_stack

    try:
        document = load_document(args.config) if args.config else {}
        config, built_in = effective_config(document, source=args.config or "<built-in default>", warn=warn,
                                            gpus=args.gpus, say=lambda text: print(text, file=sys.stderr),
                                            max_loaded=args.max_loaded, idle_unload=args.idle_unload)
        if args.print_config:
            print(f"# the effective configuration of `llamaswap up` ({config.source})")
            sys.stdout.write(yaml.safe_dump(config.to_document(), sort_keys=False))
            return 0
        config.upstream.read_api_key()  # unreadable: exit 2 before anything starts
        config.batches.read_keys(None)  # likewise the Batch API's callers' keys
        if built_in:
            ensure_default_model()
    except ConfigError as exc:
        raise exit_on(exc) from exc
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    workdir = pathlib.Path(args.workdir) if args.workdir else None
    factory = _loop_factory_or_exit()
    try:
        return run(run_stack(config, config_path=args.config, workdir=workdir,
                             otlp_endpoint=_otlp_endpoint_from_env(), grace_s=args.grace,
                             activity_path=args.activity_log, gpus=args.gpus,
                             max_loaded=args.max_loaded, idle_unload=args.idle_unload), factory)
    except StoreError as exc:  # batches.dir cannot be used: a configuration error
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


def _loop_factory_or_exit() -> Callable[[], AbstractEventLoop] | None:
    """The event loop LLAMASWAP_EVENT_LOOP asks for (`commands/event_loop.py`); exit 2 if it cannot be had."""
    from llamaswap.commands.event_loop import EventLoopError, loop_factory

    try:
        return loop_factory()
    except EventLoopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from exc


def _otlp_endpoint_from_env() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown level {text!r}; one of {', '.join(LOG_LEVELS)}")
    return level


def _gpu_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of GPUs, 1 or more, got {text!r}")
    return count


def _max_loaded(text: str) -> int:
    from llamaswap.commands.resident import max_loaded_flag

    try:
        return max_loaded_flag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _idle_unload(text: str) -> float:
    from llamaswap.commands.resident import idle_unload_flag

    try:
        return idle_unload_flag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_log_level(parser: argparse.ArgumentParser, *, default: object) -> None:
    parser.add_argument("--log-level", type=_log_level, default=default, metavar="LEVEL",
                        help=f"{', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]} (default INFO)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaswap", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_log_level(parser, default="INFO")
    parser.add_argument("--version", action="version", version=f"llamaswap {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    up = commands.add_parser("up", help="run Envoy, the sidecar and the upstream on this machine",
                             description="Run the whole stack on this machine until SIGTERM or Ctrl-C.")
    up.add_argument("-c", "--config", help="YAML configuration file; one that names no upstream (upstream.url or "
                    "upstream.command) keeps the built-in llama-server with a small model")
    up.add_argument("--gpus", type=_gpu_count, metavar="N",
                    help="start N llama-servers from upstream.command (or the built-in one) behind the one queue: "
                    "server i on the port of upstream.url + i, with CUDA_VISIBLE_DEVICES=i and --threads "
                    "max(1, cores / N) unless the command sets threads; upstreams gpu0..gpuN-1. Not with a file "
                    "that lists upstreams (`up` starts their commands). 1: the one upstream, as without --gpus")
    up.add_argument("--max-loaded", type=_max_loaded, metavar="N",
                    help="keep up to N models resident on each upstream at once (upstream.maxLoaded: N, over the "
                    "file's), and start llama-server's router keeping N (--models-max N: the built-in one, and a "
                    "command that passes --models-max or --models-dir), so that it never evicts on its own a "
                    "model llamaswap keeps. Default: the file's maxLoaded, else 1")
    up.add_argument("--idle-unload", type=_idle_unload, metavar="S",
                    help="unload a resident model once it has sat idle S seconds (upstream.idleUnloadSeconds: S, "
                    "over the file's and its globalTTL; a model's own models.<id>.ttl still applies; pinned models "
                    "stay). 0: never. Default: the file's, else never")
    up.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    up.add_argument("--workdir", help="keep logs and the generated Envoy bootstrap here (default: a temporary "
                    "directory, removed on a clean stop)")
    add_stop_options(up, stopping="when stopping",
                     activity_note="what `llamaswap simulate --activity-log` reads; ")
    up.set_defaults(run=_up)

    serve = commands.add_parser("serve", help="run the sidecar alone (what the Helm chart runs)",
                                description="Run the sidecar: gRPC for Envoy and the admin HTTP server.")
    serve.add_argument("-c", "--config", help="YAML configuration file (defaults apply without one)")
    serve.add_argument("--ports-file", help="write the bound ports as JSON here (useful with port 0)")
    add_stop_options(serve, stopping="on SIGTERM", activity_note="")
    serve.set_defaults(run=_serve)

    envoy_config = commands.add_parser("envoy-config", help="print the Envoy bootstrap for a configuration")
    envoy_config.add_argument("-c", "--config", help="YAML configuration file (defaults apply without one)")
    envoy_config.add_argument("-o", "--output", help="write it to this file instead of standard output")
    envoy_config.add_argument("--admin-port", type=int, default=ENVOY_ADMIN_PORT,
                              help=f"Envoy admin port (default {ENVOY_ADMIN_PORT})")
    envoy_config.add_argument("--admin-host", default=ENVOY_ADMIN_HOST,
                              help=f"Envoy admin address (default {ENVOY_ADMIN_HOST})")
    envoy_config.add_argument("--otlp-endpoint", help="OTLP/gRPC endpoint for Envoy's tracer "
                              "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; none disables tracing)")
    envoy_config.add_argument("--memory-limit-bytes", type=int, default=None,
                              help="Envoy's container memory limit: its overload manager's heap budget is a share "
                              "of it (envoy.maxHeapBytes: 0); the Helm chart passes the Envoy container's limit")
    envoy_config.set_defaults(run=_envoy_config)

    check = commands.add_parser("check-config", help="validate a configuration and explain its settings",
                                description="Validate a configuration as `llamaswap up` runs it (with the built-in "
                                            "upstream when it names none), check the Envoy bootstrap it generates "
                                            "with `envoy --mode validate` when Envoy is installed, and explain the "
                                            "scheduling it sets.")
    check.add_argument("-c", "--config", required=True, help="YAML configuration file")
    check.set_defaults(run=_check_config)

    from llamaswap.commands import batches, fetch_models, load_model, queue, simulate

    queue.add_parser(commands)
    batches.add_parser(commands)
    simulate.add_parser(commands)
    fetch_models.add_parser(commands)
    load_model.add_parser(commands)
    # --log-level after the subcommand too; given there, it wins (SUPPRESS keeps the top one otherwise).
    for subparser in commands.choices.values():
        _add_log_level(subparser, default=argparse.SUPPRESS)
    return parser


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Activity records are JSON lines that carry their own time: written as they are, one a
    # line, by the activity log itself (LineHandler), which spares every request a LogRecord.
    from llamaswap.runtime.activity import LOGGER_NAME, LineHandler

    activity = logging.getLogger(LOGGER_NAME)
    activity.addHandler(LineHandler())
    activity.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `llamaswap`: what it is and its commands
        parser.print_help()
        return 0
    configure_logging(str(args.log_level))
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
