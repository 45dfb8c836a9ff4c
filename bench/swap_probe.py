"""Does a question to an exiting model hold a router-mode swap? (the real llama-server, tiny models)

One llama-server in router mode (`--models-max 1`, `-t 1`) over the tests' tiny-a and tiny-b.
The main thread sends completions alternating the two models, so every request is a swap (the
loaded model's child exits, the other one starts). A second thread meanwhile asks, as fast as
answers come, `GET PATH?model=M&autoload=false` for the model the last swap left loaded, which
is the one the next swap unloads, for each PATH of `/slots`, `/metrics` and `/props` in turn
(one round of `--swaps` swaps each). A stall is a swap whose request took more than `--stall-s`
(5 s by default; a tiny model's swap takes well under a second here) or the router's
`force-killing model instance` line in its log.

Last line: `swaps N, queries Q, stalls S, force-kills K`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import threading
import time
import urllib.request

import bench_paths  # noqa: F401  (puts e2e/ on the path)
from harness import http_get
from llama import router_mode_args, run_llama_server
from tinymodels import write_tiny_pair

MODELS = ("tiny-a", "tiny-b")
PATHS = ("/slots", "/metrics", "/props")
FORCE_KILL = "force-killing model instance"


def complete(url: str, model: str, tokens: int) -> int:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status


class Asker:
    """Asks `PATH?model=<target>&autoload=false` in a loop; `target` is set by the swapping thread."""

    def __init__(self, url: str, path: str) -> None:
        self.url, self.path = url, path
        self.target = MODELS[0]
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, _ = http_get(f"{self.url}{self.path}?model={self.target}&autoload=false", timeout=30)
            except OSError:
                status = -1
            self.sent += 1
            self.statuses[status] = self.statuses.get(status, 0) + 1

    def __enter__(self) -> Asker:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swaps", type=int, default=100, help="swaps per path (default 100)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per request (default 8)")
    parser.add_argument("--stall-s", type=float, default=5.0, help="a swap slower than this is a stall")
    args = parser.parse_args()
    total_swaps = total_queries = stalls = 0
    with tempfile.TemporaryDirectory(prefix="swap-probe-") as tmp:
        models = pathlib.Path(tmp) / "models"
        write_tiny_pair(models)
        log = pathlib.Path(tmp) / "llama.log"
        with run_llama_server([*router_mode_args(models), "-t", "1"], log_path=log) as server:
            complete(server.url, MODELS[0], args.tokens)  # the first load is no swap
            loaded = MODELS[0]
            for path in PATHS:
                durations: list[float] = []
                with Asker(server.url, path) as asker:
                    for _ in range(args.swaps):
                        asker.target = loaded  # the model this swap unloads
                        other = MODELS[1] if loaded == MODELS[0] else MODELS[0]
                        start = time.monotonic()
                        complete(server.url, other, args.tokens)
                        durations.append(time.monotonic() - start)
                        loaded = other
                slow = [d for d in durations if d > args.stall_s]
                durations.sort()
                print(f"{path}: swaps {len(durations)}, queries {asker.sent} {dict(sorted(asker.statuses.items()))}, "
                      f"swap p50 {durations[len(durations) // 2]:.3f} s max {durations[-1]:.3f} s, "
                      f"stalls {len(slow)}", flush=True)
                total_swaps += len(durations)
                total_queries += asker.sent
                stalls += len(slow)
            kills = server.log_text().count(FORCE_KILL)
    print(f"swaps {total_swaps}, queries {total_queries}, stalls {stalls}, force-kills {kills}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
