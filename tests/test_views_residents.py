"""What `/queue`, `llamaswap queue` and the page's state say of a GPU that keeps several models
resident (issue 37, `maxLoaded`): each resident model with its own busy/total slots, which are
pinned, how many may be resident, and the model the best waiting request holds back there.

The GPUs are `GpuHolding` values built by hand (what the scheduler's records build), and the
held-back model is set as the scheduler's `held_back` (the scheduler's rule fills it); one model
resident at a time keeps the table it had (tests/test_views_gpus.py).
"""

from __future__ import annotations

from typing import Any

from policies import serial

from llamaswap.adapters.admin import queue_document
from llamaswap.commands.queue import render
from llamaswap.core import Estimator, ManualClock, Scheduler, Slots
from llamaswap.core.holding import GpuHolding, Running
from llamaswap.core.policy import GpuPolicy
from llamaswap.core.residency import Residency
from llamaswap.runtime.views import GpuState, QueueView, QueueViews

RESIDENCY = Residency(max_loaded=3, pinned=frozenset({"embed"}))
SLOTS = Slots(2, {"embed": 4})
POLICY = serial(aging_divisor_s=0.0).with_gpus((GpuPolicy("gpu0", SLOTS, residency=RESIDENCY),))


class HoldingBack:
    """A scheduler that says the best waiting request holds ``model`` back on each GPU (what the
    core's rule will say: `Scheduler.held_back`), the rest its own."""

    def __init__(self, scheduler: Scheduler, model: str | None) -> None:
        self._scheduler = scheduler
        self._model = model

    @property
    def held_back(self) -> dict[str, str | None]:
        return {gpu: self._model for gpu in self._scheduler.gpus} if self._model is not None else {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


class Resident:
    """Views over GPUs as ``holdings`` say (the node's summary from a scheduler told their
    residents), and what the page's documents (`adapters/ui.py`) ask of a coordinator."""

    def __init__(self, *holdings: GpuHolding, held_back: str | None = None, policy: Any = POLICY,
                 clock: ManualClock | None = None) -> None:
        self.clock = clock or ManualClock()
        core = Scheduler(policy, self.clock)
        for holding in holdings:
            core.set_residents(holding.residents, as_of=0, gpu=holding.name)
        self.scheduler = HoldingBack(core, held_back)
        self.version = 0
        self.views = QueueViews(self.scheduler, Estimator(default_run_s=10.0, default_swap_s=5.0, samples=5),  # type: ignore[arg-type]
                                self.clock, {}, {}, version=lambda: self.version, blocked=dict,
                                holdings=lambda: holdings)
        self.status_of = self.views.status_of

    def view(self) -> QueueView:
        return self.views.view()


def document(*holdings: GpuHolding, held_back: str | None = None, policy: Any = POLICY) -> dict[str, Any]:
    return queue_document(Resident(*holdings, held_back=held_back, policy=policy).view())


# chat runs twice and embed once beside it; code is resident, idle.
BUSY = GpuHolding("gpu0", SLOTS, None, frozenset({"chat", "embed", "code"}),
                  Running(3, 2, "embed", False, {"chat": (2, 2), "embed": (1, 0)}), residency=RESIDENCY)


def test_each_resident_model_with_its_own_slots_and_what_is_held_back() -> None:
    (gpu,) = document(BUSY, held_back="chat")["gpus"]
    assert (gpu["name"], gpu["resident_models"], gpu["slots_busy"], gpu["state"]) == (
        "gpu0", ["chat", "code", "embed"], 3, GpuState.RUNNING)
    assert gpu["slots"] == 2 + 2 + 4  # with several resident, the sum of theirs
    assert gpu["max_loaded"] == 3 and gpu["held_back"] == "chat"
    assert gpu["models"] == [
        {"model": "chat", "slots_busy": 2, "slots": 2, "pinned": False, "loading": False},
        {"model": "code", "slots_busy": 0, "slots": 2, "pinned": False, "loading": False},
        {"model": "embed", "slots_busy": 1, "slots": 4, "pinned": True, "loading": False}]


def test_a_model_that_runs_while_not_known_resident_is_listed_with_its_slots() -> None:
    """A load under way (its grant began by loading it) and the resident models beside it."""
    holding = GpuHolding("gpu0", SLOTS, None, frozenset({"embed"}),
                         Running(2, 1, "chat", False, {"chat": (1, 1), "embed": (1, 0)}),
                         loading=("chat", 0), residency=RESIDENCY)
    (gpu,) = document(holding)["gpus"]
    assert [(m["model"], m["slots_busy"], m["loading"]) for m in gpu["models"]] == [("chat", 1, True),
                                                                                  ("embed", 1, False)]
    assert gpu["held_back"] is None


def test_the_queue_table_gives_a_gpu_line_to_a_gpu_of_several_models() -> None:
    lines = render(document(BUSY, held_back="chat")).splitlines()
    # One GPU: the summary as before, no GPU column, and the GPU's own line under it.
    assert lines[0].startswith("policy serial, loaded models chat,code,embed, ")  # (no grants: the scheduler's)
    assert lines[1].split() == ["gpu0", "slots", "3/8", "models", "(3", "of", "3)", "chat", "2/2,", "code", "0/2,",
                                "embed", "1/4", "pinned", "3", "running,", "holding", "back", "chat", "(no", "new",
                                "grants", "until", "it", "drains", "and", "is", "unloaded)"]
    assert lines[2].split()[-1] == "MODEL"


def test_an_idle_gpu_of_several_models_says_so_and_holds_nothing_back() -> None:
    idle = BUSY._replace(running=Running())
    lines = render(document(idle)).splitlines()
    assert lines[1].split() == ["gpu0", "slots", "0/8", "models", "(3", "of", "3)", "chat", "0/2,", "code", "0/2,",
                                "embed", "0/4", "pinned", "idle"]


def test_one_model_at_a_time_keeps_its_table() -> None:
    """`maxLoaded: 1` (the default): no GPU line for one GPU, its document's new fields say so."""
    policy = serial(aging_divisor_s=0.0)
    holding = GpuHolding("gpu0", Slots(), None, frozenset({"a"}), Running(1, 1, "a"))
    queue = document(holding, policy=policy)
    assert queue["gpus"][0]["max_loaded"] == 1 and queue["gpus"][0]["held_back"] is None
    lines = render(queue).splitlines()
    assert lines[0].startswith("policy serial, loaded model a, ")
    assert lines[1].split()[0] == "POS"


def test_a_gpu_shown_model_by_model_says_so() -> None:
    """The server decides what the page and `llamaswap queue` show: ``per_model`` on a GPU that
    may keep several models, and ``per_gpu`` (a line per GPU) for the node, even of one GPU."""
    queue = document(BUSY, held_back="chat")
    assert queue["per_gpu"] is True and queue["gpus"][0]["per_model"] is True
    one = document(GpuHolding("gpu0", Slots(), None, frozenset({"a"}), Running(1, 1, "a")),
                   policy=serial(aging_divisor_s=0.0))
    assert one["per_gpu"] is False and one["gpus"][0]["per_model"] is False


def test_the_schedulers_own_gpus_and_held_back_model_reach_the_document() -> None:
    """Two models resident (two slots each), both busy: a request for a third holds back one of
    them (the core's rule), and /queue shows it beside each model's slots."""
    from llamaswap.core import Priority, PrioritySource

    clock = ManualClock()
    policy = serial(aging_divisor_s=0.0).with_gpus((GpuPolicy("gpu0", Slots(2), residency=Residency(max_loaded=2)),))
    scheduler = Scheduler(policy, clock)
    for token, model, priority in (("a1", "a", 0), ("b1", "b", 0)):
        scheduler.enqueue(token, Priority(priority, PrioritySource.NUMBER), model)
    assert [decision.model for decision in iter(scheduler.next, None)] == ["a", "b"]
    scheduler.enqueue("c1", Priority(100, PrioritySource.NUMBER), "c")
    assert scheduler.next() is None
    views = QueueViews(scheduler, Estimator(default_run_s=10.0, default_swap_s=5.0, samples=5), clock, {}, {},
                       version=lambda: 1, blocked=dict)
    (gpu,) = queue_document(views.view())["gpus"]
    assert gpu["held_back"] in ("a", "b") and gpu["max_loaded"] == 2
    assert [(m["model"], m["slots_busy"], m["slots"]) for m in gpu["models"]] == [("a", 1, 2), ("b", 1, 2)]
    assert "holding back" in render(queue_document(views.view())).splitlines()[1]
