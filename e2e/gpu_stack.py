"""A node of several upstreams behind the real Envoy and the real sidecar (issue 27): the
configuration's `upstreams:` list, one entry per upstream (a fake of e2e/fake_llama.py or a real
llama-server), and the sidecar's ports fixed so that either process can be killed and started
again while the other runs on (as e2e/test_reliability.py does for one upstream).

`running_node` tears down whatever is current when the block ends: the tests replace
`node.sidecar` and `node.envoy` when they restart them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import signal
from collections.abc import Iterator
from typing import Any

from harness import EnvoyProcess, SidecarProcess, free_port, merge, write_config
from llamaswap.config import parse_config
from llamaswap.envoy.bootstrap import build_bootstrap


@dataclasses.dataclass
class Node:
    sidecar: SidecarProcess
    envoy: EnvoyProcess
    config_path: pathlib.Path
    bootstrap: dict[str, Any]
    workdir: pathlib.Path
    envoy_concurrency: int
    restarts: int = 0

    @property
    def url(self) -> str:
        return self.envoy.url

    def queue(self) -> dict[str, Any]:
        return self.sidecar.queue()

    def waiting(self) -> list[str]:
        return [row["request_id"] for row in self.sidecar.queue()["waiting"]]

    def running(self) -> list[str]:
        return [row["request_id"] for row in self.sidecar.queue()["running_all"]]

    def gpus(self, key: str = "state") -> dict[str, Any]:
        """Each upstream's `key` as GET /queue's `gpus` shows it (state, resident_models, slots, ...)."""
        return {row["name"]: row[key] for row in self.sidecar.queue()["gpus"]}

    def restart_sidecar(self) -> SidecarProcess:
        """SIGKILL the sidecar and start a new one on the same ports (Envoy reconnects to it)."""
        self.restarts += 1
        self.sidecar.popen.kill()
        self.sidecar.stop()
        self.sidecar = SidecarProcess(self.config_path, self.workdir, name=f"sidecar-{self.restarts + 1}")
        return self.sidecar

    def kill_envoy(self, signum: int = signal.SIGKILL) -> None:
        self.envoy.signal(signum)
        self.envoy.popen.wait(30)
        self.envoy.stop()

    def start_envoy(self) -> EnvoyProcess:
        self.restarts += 1
        self.envoy = EnvoyProcess(self.bootstrap, self.workdir, name=f"envoy-{self.restarts + 1}",
                                  concurrency=self.envoy_concurrency)
        return self.envoy


def node_document(upstreams: list[dict[str, Any]], config: dict[str, Any] | None = None) -> dict[str, Any]:
    """A configuration with these `upstreams:` entries and the sidecar on fixed loopback ports."""
    return merge({
        "listen": {"http": "127.0.0.1:0", "grpc": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"},
        # No model poll: what the sidecar knows of each upstream's loaded model comes from its
        # start-up settle and its own grants, so that a test's question re-runs nothing.
        "upstream": {"modelsPollSeconds": 0},
        "upstreams": upstreams,
        # Short leases: a lost grant is found within a second or two.
        "envoy": {"leaseSeconds": 1.5},
    }, config or {})


@contextlib.contextmanager
def running_node(workdir: pathlib.Path, upstreams: list[dict[str, Any]], config: dict[str, Any] | None = None, *,
                 envoy_concurrency: int = 2) -> Iterator[Node]:
    """The sidecar and Envoy in front of ``upstreams`` (entries of `upstreams:`), stopped whatever
    happens; their logs are printed when the block fails."""
    document = node_document(upstreams, config)
    config_path = write_config(workdir, document)
    bootstrap = build_bootstrap(parse_config(document), envoy_admin_port=0)
    sidecar = SidecarProcess(config_path, workdir)
    node = None
    try:
        envoy = EnvoyProcess(bootstrap, workdir, concurrency=envoy_concurrency)
        node = Node(sidecar, envoy, config_path, bootstrap, workdir, envoy_concurrency)
        failed = True
        try:
            yield node
            failed = False
        finally:
            if failed:
                node.envoy.dump()
                node.sidecar.dump()
    finally:
        for part in ((node.envoy, node.sidecar) if node is not None else (sidecar,)):
            with contextlib.suppress(Exception):
                part.stop()
