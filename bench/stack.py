"""The stacks the data-path benchmarks (overhead.py, dispatch.py, queued.py) measure, torn down on exit.

They reuse the end-to-end harness (`e2e/harness.py`): the real Envoy binary, the real sidecar
process (`python -m llamaswap serve`) and the fake llama-server, in a process of its own
(`fake_upstream.py`).

"Bare Envoy" is the same bootstrap (`build_bootstrap`) with json_to_metadata, ext_authz and
the gRPC access log taken out, in front of the same upstream: the baseline every figure is
compared with. "The floor" (`floor.py`) is the same bootstrap in front of a do-nothing grpc.aio
server with the same protocol (a ticket in the Check's dynamic metadata, the release from the
access log). Both are measured in the same run as llamaswap, because this machine is shared and
noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

import yaml

import bench_paths  # noqa: F401 - puts e2e/ on the path
from fake_upstream import UpstreamProcess
from floor import NullSidecar
from harness import EnvoyProcess, Stack, running_stack
from llamaswap.config import parse_config
from llamaswap.envoy.bootstrap import EXT_AUTHZ, JSON_TO_METADATA, UNROUTED_CLUSTER, build_bootstrap
from llamaswap.envoy.contract import upstream_cluster


def bare_bootstrap(bootstrap: dict[str, Any], upstream: str) -> dict[str, Any]:
    """The same bootstrap without json_to_metadata, ext_authz (and their per-route config) and the
    gRPC access log: buffer -> router, everything else as it was, except that the route a request
    takes when no Check's OK named an upstream (x-llamaswap-upstream) goes to `upstream`'s cluster,
    as with envoy.failOpen, instead of the endpoint-less one (a 503: no Check names one here)."""
    bare = copy.deepcopy(bootstrap)
    for listener in bare["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                hcm = network_filter["typed_config"]
                hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in (JSON_TO_METADATA, EXT_AUTHZ)]
                hcm.pop("access_log", None)
                hcm.pop("access_log_options", None)
                for host in hcm["route_config"]["virtual_hosts"]:
                    for route in host["routes"]:
                        route.pop("typed_per_filter_config", None)
                        if route.get("route", {}).get("cluster") == UNROUTED_CLUSTER:
                            route["route"]["cluster"] = upstream_cluster(upstream)
    return bare


# The production defaults where the e2e harness shortens them for its tests (leaseSeconds 1.5).
BENCH_CONFIG: dict[str, Any] = {"envoy": {"leaseSeconds": 3.0}}


class Bench:
    """Upstream process + llamaswap + Envoy (+ a bare Envoy, + the floor), torn down on exit."""

    def __init__(self, stack: Stack, upstream: UpstreamProcess, bare: EnvoyProcess | None, workdir: pathlib.Path,
                 null: NullSidecar | None = None):
        self.stack = stack
        self.upstream = upstream
        self.bare = bare
        self.workdir = workdir
        self.null = null

    @property
    def sidecar_url(self) -> str:
        return self.stack.url

    @property
    def bare_url(self) -> str:
        assert self.bare is not None
        return self.bare.url

    @property
    def sidecar_pid(self) -> int:
        return self.stack.sidecar.popen.pid

    @property
    def envoy_pid(self) -> int:
        return self.stack.envoy.popen.pid

    def envoy_stat(self, name: str) -> int:
        return self.stack.envoy.stat(name)


@contextlib.contextmanager
def sidecar_command(argv: list[str] | None) -> Iterator[None]:
    """Run llamaswap's sidecar with another command (e.g. under a profiler) while the block runs."""
    import harness

    if argv is None:
        yield
        return
    original = harness.sidecar_command
    harness.sidecar_command = lambda: list(argv)
    try:
        yield
    finally:
        harness.sidecar_command = original


@contextlib.contextmanager
def bench_stack(config: dict[str, Any] | None = None, *, bare: bool = True, null: bool = False,
                null_serial: bool = False, keep: str | None = None,
                sidecar_env: dict[str, str] | None = None, sidecar_argv: list[str] | None = None) -> Iterator[Bench]:
    """Start everything; logs go to a temporary folder (kept, and printed, if `keep`).

    `bare`: also a bare Envoy; `null`: also Envoy + the do-nothing sidecar (the floor), a toy
    FIFO one if `null_serial`; `sidecar_env`: extra environment for llamaswap's sidecar (the
    floor gets the same PYTHONPATH); `sidecar_argv`: llamaswap's sidecar command instead of
    `python -m llamaswap` (`serve ...` is appended)."""
    workdir = pathlib.Path(keep) if keep else pathlib.Path(tempfile.mkdtemp(prefix="llamaswap-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    upstream = UpstreamProcess(workdir)
    bare_envoy = None
    null_sidecar = None
    document_config = merge_config(BENCH_CONFIG, config or {})
    try:
        with sidecar_command(sidecar_argv), running_stack(workdir, document_config, upstream_url=upstream.url,
                                                          sidecar_env=sidecar_env) as stack:
            document = yaml.safe_load(stack.config_path.read_text())
            if null:
                null_sidecar = NullSidecar(workdir, document, serial=null_serial)
            if bare:
                bootstrap = build_bootstrap(parse_config(document), grpc_port=stack.sidecar.grpc_port,
                                            admin_port=stack.sidecar.admin_port, envoy_admin_port=0)
                upstream_name = parse_config(document).gpu_entries[0].name
                bare_envoy = EnvoyProcess(bare_bootstrap(bootstrap, upstream_name), workdir, name="envoy-bare")
            try:
                yield Bench(stack, upstream, bare_envoy, workdir, null_sidecar)
            finally:
                if bare_envoy is not None:
                    bare_envoy.stop()
                if null_sidecar is not None:
                    null_sidecar.close()
    finally:
        upstream.close()
        if keep:
            print(f"logs kept in {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def merge_config(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    from harness import merge

    return merge(copy.deepcopy(base), extra)


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every stack benchmark takes: the old --floor, the sidecar's environment, --keep."""
    parser.add_argument("--floor", action="store_true", help="(kept for old command lines: the floor always runs)")
    parser.add_argument("--sidecar-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the llamaswap sidecar (repeatable), e.g. OTEL_SDK_DISABLED=true")
    parser.add_argument("--keep", help="keep logs and configs in this folder")


def sidecar_env_of(args: argparse.Namespace) -> dict[str, str]:
    """--sidecar-env KEY=VALUE ... as a mapping."""
    return dict(item.split("=", 1) for item in args.sidecar_env)



@contextlib.contextmanager
def workdir(keep: str | None, name: str) -> Iterator[pathlib.Path]:
    """Where a benchmark's stacks keep their files: ``keep`` (--keep DIR, left for reading), else
    a temporary directory named after the benchmark, removed at the end."""
    if keep:
        path = pathlib.Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=f"llamaswap-bench-{name}-") as tmp:
        yield pathlib.Path(tmp)
