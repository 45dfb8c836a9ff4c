"""One queue over two GPUs (issue 27), through the real Envoy and the real sidecar, with two fake
llama-servers in router mode (e2e/fake_llama.py) as `upstreams:` gpu0 and gpu1: a free GPU takes
the waiting request it can serve, never two models on one server, affinity per server, a drain
on one server while the other serves, and a settle, an adoption or a restart per server.

What ran where and when is read from the fakes' own records (each hit's start and end, the
model it loaded, `mixed`: a completion started while another model computed), not from what the
sidecar says. Requests are held at the fakes (`x-test-hold`) where a test needs work to run
while it looks; nothing waits on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pathlib
import random
from collections.abc import Iterator
from typing import Any

import aiohttp

from client import Reply, chat
from fake_llama import FakeLlamaServer, UpstreamHit
from harness import activity_records, async_wait_for, merge
from gpu_stack import Node, running_node

# The node rule weighs a swap on an idle GPU against waiting for a slot where the model is
# loaded (issue 27): a swap costs nothing here and a run is long until measured, so a free GPU
# always takes work it may serve rather than leave it waiting for a busy one.
CHEAP_SWAPS = {"estimates": {"defaultRunSeconds": 3600, "defaultSwapSeconds": 0},
               "upstream": {"abandonedGeneration": "wait"}}


@contextlib.contextmanager
def two_fakes(loaded: tuple[str | None, str | None] = (None, None)
              ) -> Iterator[tuple[FakeLlamaServer, FakeLlamaServer]]:
    """Two router-mode fakes (models a, b, c; one in memory at a time), gpu0's and gpu1's. A test
    in which the sidecar's own questions loaded a model on either fails."""
    fakes: list[FakeLlamaServer] = []
    try:
        for model in loaded:
            fakes.append(FakeLlamaServer(router=True, loaded=model).started())
        yield fakes[0], fakes[1]
        for name, fake in zip(("gpu0", "gpu1"), fakes):
            assert fake.autoloaded == [], f"the sidecar's GET /slots or /props loaded {fake.autoloaded} on {name}"
    finally:
        for fake in fakes:
            fake.close()


def entries(gpu0: FakeLlamaServer, gpu1: FakeLlamaServer, *, slots: int = 1,
            models: tuple[list[str] | None, list[str] | None] = (None, None)) -> list[dict[str, Any]]:
    out = []
    for name, fake, served in (("gpu0", gpu0, models[0]), ("gpu1", gpu1, models[1])):
        entry: dict[str, Any] = {"name": name, "url": fake.url, "slots": slots}
        if served is not None:
            entry["models"] = served
        out.append(entry)
    return out


def completions(fake: FakeLlamaServer) -> dict[str, UpstreamHit]:
    with fake.lock:
        return {hit.test_id: hit for hit in fake.hits if hit.path.endswith("/completions")}


def models_overlap(fake: FakeLlamaServer) -> list[tuple[str, str]]:
    """Pairs of completions of different models whose runs overlapped at the fake (by its own
    clock; a run still going counts as going on)."""
    hits = list(completions(fake).values())
    return [(one.test_id, other.test_id) for one, other in itertools.combinations(hits, 2)
            if one.model != other.model and one.start_ns < (other.end_ns or 1 << 62)
            and other.start_ns < (one.end_ns or 1 << 62)]


def one_model_at_a_time(fake: FakeLlamaServer) -> None:
    assert fake.mixed == [], f"completions started while another model computed: {fake.mixed}"
    assert fake.most_models <= 1 and models_overlap(fake) == []


async def _at(fake: FakeLlamaServer, test_id: str) -> None:
    await async_wait_for(lambda: test_id in fake.order(), what=f"{test_id} at its fake")


async def _waiting(node: Node, *test_ids: str) -> None:
    await async_wait_for(lambda: set(test_ids) <= set(node.waiting()), what=f"{test_ids} waiting in the sidecar")


async def test_two_models_arriving_at_once_run_at_once_one_per_gpu_and_a_free_gpu_takes_the_next(
        tmp_path: pathlib.Path) -> None:
    """Nothing is loaded anywhere; a request for model-a and one for model-b arrive together: both
    run at once, one on each fake. a2 then waits (both busy, one slot each); when b1 ends, the
    GPU it leaves takes a2, loading model-a, although a1 still runs where model-a is loaded:
    a free GPU does not idle while a request it may serve waits."""
    with two_fakes() as (gpu0, gpu1), running_node(tmp_path, entries(gpu0, gpu1), CHEAP_SWAPS) as node:
        async with aiohttp.ClientSession() as session:
            first = [asyncio.create_task(chat(session, node.url, test_id, model=model, hold=True))
                     for test_id, model in (("a1", "model-a"), ("b1", "model-b"))]
            await async_wait_for(lambda: len(completions(gpu0)) + len(completions(gpu1)) == 2,
                                 what="a1 and b1 at the fakes")
            # Both computing at once, one per fake.
            assert (gpu0.active, gpu1.active) == (1, 1)
            on_a, on_b = (gpu0, gpu1) if "a1" in completions(gpu0) else (gpu1, gpu0)
            assert (list(completions(on_a)), list(completions(on_b))) == (["a1"], ["b1"])

            a2 = asyncio.create_task(chat(session, node.url, "a2", model="model-a", hold=True))
            await _waiting(node, "a2")
            on_b.release("b1")
            assert (await first[1]).status == 200
            await _at(on_b, "a2")
            assert not on_a.finished("a1") and on_a.active == 1  # a1 still runs where model-a was loaded
            assert completions(on_b)["a2"].loaded and on_b.states["model-a"] == "loaded"
            on_a.release("a1")
            on_b.release("a2")
            replies = [await first[0], await a2]
        assert [reply.status for reply in replies] == [200, 200]
        assert "a2" not in on_a.order()
        for fake in (gpu0, gpu1):
            one_model_at_a_time(fake)
            assert fake.max_active == 1


async def test_a_mixed_burst_never_puts_two_models_on_one_gpu(tmp_path: pathlib.Path) -> None:
    """Thirty requests for three models (streamed and not, of different lengths) over two GPUs of
    two slots each, where only two models can be loaded at a time: swaps are needed, and each
    waits until its GPU has drained. Each fake saw at most one model computing at any moment and
    never more than its slots, every request ran exactly once, and both GPUs served."""
    rng = random.Random(27)
    plan = [(f"r{i}", rng.choice(("model-a", "model-b", "model-c")), rng.choice((5, 20, 60)), rng.random() < 0.3)
            for i in range(30)]
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1, slots=2), {"activity": {"recent": 100}}) as node:
        async with aiohttp.ClientSession() as session:
            replies = await asyncio.gather(*(chat(session, node.url, test_id, model=model, sleep_ms=ms, stream=stream)
                                             for test_id, model, ms, stream in plan))
        assert [reply.status for reply in replies] == [200] * len(plan)
        served = [*completions(gpu0), *completions(gpu1)]
        assert sorted(served) == sorted(test_id for test_id, *_ in plan)  # each exactly once
        assert completions(gpu0) and completions(gpu1)
        for fake in (gpu0, gpu1):
            one_model_at_a_time(fake)
            assert fake.max_active <= 2
            by_id = completions(fake)
            assert all(by_id[test_id].model == model for test_id, model, *_ in plan if test_id in by_id)
        # model-c was loaded nowhere at first: some GPU swapped to it (after draining, as above).
        assert any(hit.loaded for fake in (gpu0, gpu1) for hit in completions(fake).values() if hit.model == "model-c")


async def test_each_request_goes_to_the_gpu_that_has_its_model_loaded(tmp_path: pathlib.Path) -> None:
    """gpu0 has model-a loaded, gpu1 model-b, two slots each. a2 takes the free slot beside a1 on
    gpu0, not the idle gpu1 (which would have to swap); b1 goes to gpu1; a3, with gpu0 full,
    waits for gpu0 rather than swap gpu1 away from model-b, while b2 still joins b1 there. No
    completion loaded a model."""
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1, slots=2)) as node:
        async with aiohttp.ClientSession() as session:
            tasks = {}
            for test_id, model, fake in (("a1", "model-a", gpu0), ("a2", "model-a", gpu0), ("b1", "model-b", gpu1)):
                tasks[test_id] = asyncio.create_task(chat(session, node.url, test_id, model=model, hold=True))
                await _at(fake, test_id)
                assert gpu1.active == (1 if test_id == "b1" else 0)  # gpu1 idle until b1
            tasks["a3"] = asyncio.create_task(chat(session, node.url, "a3", model="model-a", hold=True))
            await _waiting(node, "a3")
            tasks["b2"] = asyncio.create_task(chat(session, node.url, "b2", model="model-b", hold=True))
            await _at(gpu1, "b2")
            assert node.waiting() == ["a3"]
            gpu0.release("a1")
            await _at(gpu0, "a3")
            for test_id in ("a2", "a3", "b1", "b2"):
                (gpu0 if test_id.startswith("a") else gpu1).release(test_id)
            replies = {test_id: await task for test_id, task in tasks.items()}
        assert {reply.status for reply in replies.values()} == {200}
        assert (list(completions(gpu0)), list(completions(gpu1))) == (["a1", "a2", "a3"], ["b1", "b2"])
        assert not any(hit.loaded for fake in (gpu0, gpu1) for hit in completions(fake).values())
        assert completions(gpu0)["a3"].start_ns >= completions(gpu0)["a1"].end_ns  # two slots, never three
        for fake in (gpu0, gpu1):
            one_model_at_a_time(fake)
            assert fake.max_active == 2


async def test_one_gpu_drains_for_a_model_loaded_nowhere_while_the_other_serves(tmp_path: pathlib.Path) -> None:
    """gpu0 has model-a loaded and runs a1, gpu1 model-b and runs b1 (two slots each). The best
    request, interactive c1, needs model-c, loaded nowhere: one GPU (gpu0, expected to drain
    first: its work started first) takes no new work, not even a2 of its own model for its free
    slot, while gpu1 goes on serving model-b (b2, then b3). Once a1 ends, c1 swaps gpu0 to
    model-c; gpu1 never ran model-c."""
    config = {**CHEAP_SWAPS, "routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 0}}}}}
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1, slots=2), config) as node:
        async with aiohttp.ClientSession() as session:
            tasks: dict[str, asyncio.Task[Reply]] = {}

            def send(test_id: str, model: str, priority: str | None = None) -> None:
                tasks[test_id] = asyncio.create_task(chat(session, node.url, test_id, model=model, hold=True,
                                                          priority=priority))

            send("a1", "model-a")
            await _at(gpu0, "a1")
            send("b1", "model-b")
            await _at(gpu1, "b1")
            send("c1", "model-c", "interactive")
            await _waiting(node, "c1")
            send("a2", "model-a", "batch")  # fits gpu0's free slot, but gpu0 drains for c1
            await _waiting(node, "a2")
            send("b2", "model-b")
            await _at(gpu1, "b2")  # gpu1 serves on
            gpu1.release("b2")
            assert (await tasks["b2"]).status == 200
            send("b3", "model-b")
            await _at(gpu1, "b3")
            assert node.waiting() == ["c1", "a2"]
            assert list(completions(gpu0)) == ["a1"]  # gpu0 took nothing new
            gpu0.release("a1")
            await _at(gpu0, "c1")
            hits = completions(gpu0)
            assert hits["c1"].loaded and hits["c1"].start_ns >= hits["a1"].end_ns
            for fake, test_id in ((gpu0, "c1"), (gpu1, "b1"), (gpu1, "b3"), (gpu0, "a2"), (gpu1, "a2")):
                fake.release(test_id)
            replies = {test_id: await task for test_id, task in tasks.items()}
        assert {reply.status for reply in replies.values()} == {200}
        assert "model-c" not in {hit.model for hit in completions(gpu1).values()}
        b3 = completions(gpu1)["b3"]
        assert b3.start_ns < completions(gpu0)["a1"].end_ns  # gpu1 served while gpu0 drained
        for fake in (gpu0, gpu1):
            one_model_at_a_time(fake)


async def test_an_abandoned_generation_holds_its_gpu_until_its_slots_say_idle_while_the_other_serves(
        tmp_path: pathlib.Path) -> None:
    """A client leaves a1, running on gpu0; the fake goes on computing it (as llama-server does a
    non-streamed generation). gpu0 takes nothing (a2 waits) until its own /slots says idle, while
    gpu1 serves b1 and b2 meanwhile. Each GPU serves one model here (`models`), so a2 can only
    wait for gpu0."""
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1, models=(["model-a"], ["model-b"])), CHEAP_SWAPS) as node:
        async with aiohttp.ClientSession() as session:
            async with aiohttp.ClientSession() as doomed:
                a1 = asyncio.create_task(chat(doomed, node.url, "a1", model="model-a", hold=True))
                await _at(gpu0, "a1")
                a1.cancel()
                await asyncio.gather(a1, return_exceptions=True)
            # Its grant ended; its record waits for the settle (it says how long that took).
            await async_wait_for(lambda: node.gpus() == {"gpu0": "settling", "gpu1": "idle"}, what="gpu0 settling")
            asked_before = len(gpu0.slots_asked)
            a2 = asyncio.create_task(chat(session, node.url, "a2", model="model-a"))
            await _waiting(node, "a2")
            others = await asyncio.gather(*(chat(session, node.url, test_id, model="model-b")
                                            for test_id in ("b1", "b2")))
            assert [reply.status for reply in others] == [200, 200]
            await async_wait_for(lambda: len(gpu0.slots_asked) > asked_before, what="gpu0's /slots asked again")
            assert node.waiting() == ["a2"] and gpu0.order() == ["a1"] and gpu0.active == 1
            gpu0.release("a1")  # the abandoned generation ends at the fake
            assert (await a2).status == 200
            records = await async_wait_for(lambda: activity_records(node.sidecar.admin_url, {"a1", "a2"}),
                                           what="the records")
        assert records["a1"]["outcome"] == "cancelled_running" and records["a1"]["settle_ms"] > 0
        hits0, hits1 = completions(gpu0), completions(gpu1)
        assert hits0["a2"].start_ns >= hits0["a1"].end_ns
        assert all(hits1[test_id].end_ns < hits0["a1"].end_ns for test_id in ("b1", "b2"))
        assert "model-a" in gpu0.slots_asked  # what the settle asked (autoload=false: it loads nothing)
        for fake in (gpu0, gpu1):
            one_model_at_a_time(fake)
            assert fake.max_active == 1


async def test_stopping_an_abandoned_generation_unloads_its_own_gpu_only(tmp_path: pathlib.Path) -> None:
    """upstream.abandonedGeneration: stop. A client leaves b1 on gpu1 (not the first upstream,
    where a name lost on the way would land) while a1 runs on gpu0: the stop (router mode: unload
    the model, which ends what that server computes) goes to gpu1's server alone; a1 runs on to
    its end, and b2 then loads model-b on gpu1 again."""
    config = merge(CHEAP_SWAPS, {"upstream": {"abandonedGeneration": "stop"}})
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1, models=(["model-a"], ["model-b"])), config) as node:
        async with aiohttp.ClientSession() as session:
            a1 = asyncio.create_task(chat(session, node.url, "a1", model="model-a", hold=True))
            await _at(gpu0, "a1")
            async with aiohttp.ClientSession() as doomed:
                b1 = asyncio.create_task(chat(doomed, node.url, "b1", model="model-b", hold=True))
                await _at(gpu1, "b1")
                b1.cancel()
                await asyncio.gather(b1, return_exceptions=True)
            await async_wait_for(lambda: gpu1.states["model-b"] == "unloaded" and gpu1.active == 0,
                                 what="model-b unloaded on gpu1, b1 stopped")
            b2 = await chat(session, node.url, "b2", model="model-b")
            assert b2.status == 200 and completions(gpu1)["b2"].loaded
            assert gpu0.states["model-a"] == "loaded" and not gpu0.finished("a1") and gpu0.active == 1
            gpu0.release("a1")
            assert (await a1).status == 200  # not cut by the stop on gpu1
            records = await async_wait_for(lambda: activity_records(node.sidecar.admin_url, {"a1", "b1", "b2"}),
                                           what="the records")
        assert records["b1"]["outcome"] == "cancelled_running" and records["a1"]["outcome"] == "served"
        for fake in (gpu0, gpu1):
            one_model_at_a_time(fake)
            assert fake.max_active == 1


async def _work_on_both_gpus(node: Node, session: aiohttp.ClientSession, gpu0: FakeLlamaServer,
                             gpu1: FakeLlamaServer) -> list[asyncio.Task[Reply]]:
    """a1 held on gpu0 and b1 on gpu1, with Envoy's access-log stream open (a periodic entry)."""
    tasks = []
    for test_id, model, fake in (("a1", "model-a", gpu0), ("b1", "model-b", gpu1)):
        tasks.append(asyncio.create_task(chat(session, node.url, test_id, model=model, hold=True)))
        await _at(fake, test_id)
    written = "access_logs.grpc_access_log.logs_written"
    await async_wait_for(lambda: node.envoy.stat(written) > 0, what="a periodic access-log entry")
    return tasks


async def _each_gpu_waits_for_its_own_exchange(node: Node, session: aiohttp.ClientSession, gpu0: FakeLlamaServer,
                                               gpu1: FakeLlamaServer) -> None:
    """a2 and b2 wait while a1 and b1 still compute; b1's end lets b2 run on gpu1 while a2 still
    waits for a1, and a1's end lets a2 run on gpu0: each GPU waited for its own exchange only."""
    later = [asyncio.create_task(chat(session, node.url, test_id, model=model))
             for test_id, model in (("a2", "model-a"), ("b2", "model-b"))]
    await _waiting(node, "a2", "b2")
    assert (gpu0.order(), gpu1.order()) == (["a1"], ["b1"])
    gpu1.release("b1")
    await _at(gpu1, "b2")
    assert (await later[1]).status == 200
    assert node.waiting() == ["a2"] and gpu0.order() == ["a1"]
    gpu0.release("a1")
    assert (await later[0]).status == 200
    hits0, hits1 = completions(gpu0), completions(gpu1)
    assert hits1["b2"].start_ns >= hits1["b1"].end_ns and hits0["a2"].start_ns >= hits0["a1"].end_ns
    assert hits1["b2"].end_ns < hits0["a1"].end_ns  # gpu1 served while gpu0's exchange still ran
    for fake in (gpu0, gpu1):
        one_model_at_a_time(fake)
        assert fake.max_active == 1


async def test_a_restarted_sidecar_adopts_each_running_exchange_on_its_own_gpu(tmp_path: pathlib.Path) -> None:
    """The sidecar is killed while a1 runs on gpu0 and b1 on gpu1. The new process adopts each
    exchange from Envoy's entries, on the upstream the entry names, and grants nothing on a GPU
    until its own exchange has ended."""
    # The new process's start-up settle gives up on the busy fakes after 1 s: what then holds
    # each GPU is its adopted exchange alone (one adopted on the wrong GPU leaves its own free).
    config = merge(CHEAP_SWAPS, {"upstream": {"settleTimeoutSeconds": 1}})
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1, models=(["model-a"], ["model-b"])), config,
                         envoy_concurrency=1) as node:
        async with aiohttp.ClientSession() as session:
            first = await _work_on_both_gpus(node, session, gpu0, gpu1)
            sidecar = node.restart_sidecar()
            adopted = "Envoy reports an exchange this sidecar does not hold"
            await async_wait_for(lambda: sidecar.log().count(adopted) == 2, what="both running exchanges adopted")
            # Each start-up settle over (found idle beyond what is adopted, or given up): adopted alone.
            await async_wait_for(lambda: node.gpus() == {"gpu0": "adopted", "gpu1": "adopted"},
                                 what="each GPU held by its adopted exchange alone")
            await _each_gpu_waits_for_its_own_exchange(node, session, gpu0, gpu1)
            replies = await asyncio.gather(*first)
        assert [reply.status for reply in replies] == [200, 200]  # neither exchange was cut by the restart


async def test_after_envoy_is_killed_each_gpu_settles_its_own_abandoned_generation(tmp_path: pathlib.Path) -> None:
    """Envoy is killed while a1 runs on gpu0 and b1 on gpu1; the fakes go on computing both. The
    grants end with Envoy's connection, each GPU settles on its own: once a new Envoy is up, b2
    runs on gpu1 as soon as b1 has ended there, while a2 waits for a1 on gpu0."""
    with two_fakes(("model-a", "model-b")) as (gpu0, gpu1), \
            running_node(tmp_path, entries(gpu0, gpu1, models=(["model-a"], ["model-b"])), CHEAP_SWAPS,
                         envoy_concurrency=1) as node:
        async with aiohttp.ClientSession() as session:
            first = await _work_on_both_gpus(node, session, gpu0, gpu1)
            node.kill_envoy()
            await asyncio.gather(*first, return_exceptions=True)
            # Both grants ended (their records wait for the settles); the fakes still compute.
            await async_wait_for(lambda: node.gpus() == {"gpu0": "settling", "gpu1": "settling"},
                                 what="both grants ended with Envoy, each GPU settling")
            assert node.running() == []
            assert (gpu0.active, gpu1.active) == (1, 1)
            node.start_envoy()
            await _each_gpu_waits_for_its_own_exchange(node, session, gpu0, gpu1)
            records = await async_wait_for(lambda: activity_records(node.sidecar.admin_url, {"a1", "b1"}),
                                           what="the records of a1 and b1")
        for test_id in ("a1", "b1"):
            assert records[test_id]["outcome"] in ("proxy_gone", "lease_expired") and records[test_id]["settle_ms"] > 0


async def test_llama_servers_metrics_are_read_from_every_gpu_labelled_with_it(tmp_path: pathlib.Path) -> None:
    """GET /llamaswap/v1/upstream/metrics through Envoy reads each GPU's llama-server (its loaded
    model's metrics, loading nothing), each sample labelled with its upstream; with gpu1's server
    gone the page still has gpu0's, and a comment says gpu1 was not read."""
    gpu0 = FakeLlamaServer(router=True, loaded="model-a").started()
    gpu1 = FakeLlamaServer(router=True, loaded="model-b").started()
    running = [gpu0, gpu1]
    try:
        with running_node(tmp_path, entries(gpu0, gpu1)) as node:
            async with aiohttp.ClientSession() as session:
                async def scrape() -> tuple[int, list[str]]:
                    async with session.get(f"{node.url}/llamaswap/v1/upstream/metrics") as response:
                        return response.status, (await response.text()).splitlines()

                status, lines = await scrape()
                assert status == 200, lines
                assert [line for line in lines if not line.startswith("#")] == [
                    'llamacpp:tokens_predicted_total{upstream="gpu0",model="model-a"} 42',
                    'llamacpp:tokens_predicted_total{upstream="gpu1",model="model-b"} 42']
                assert lines.count("# TYPE llamacpp:tokens_predicted_total counter") == 1
                assert (gpu0.metrics_asked, gpu1.metrics_asked) == (["model-a"], ["model-b"])
                running.remove(gpu1)
                gpu1.close()
                status, lines = await scrape()
        assert status == 200, lines
        assert lines[0].startswith("# llamaswap: upstream gpu1 not read: upstream not answering"), lines
        assert 'llamacpp:tokens_predicted_total{upstream="gpu0",model="model-a"} 42' in lines
        assert not any('upstream="gpu1"' in line for line in lines)
        for fake in (gpu0, gpu1):
            assert fake.autoloaded == [] and set(fake.states.values()) == {"loaded", "unloaded"}
    finally:
        for fake in running:
            fake.close()
