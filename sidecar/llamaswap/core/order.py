"""The dispatch order: who wins the next grant (`pick`), and the order the queue's snapshot shows.

The snapshot's order is the order `Scheduler.next` grants in when the grants are taken one at a
time, because both use the same `pick` (with several slots, a reserved slot can let an
interactive request start before a non-interactive one listed ahead of it). Over several GPUs
the order is best score first, with the swap-affinity bonus where a request's model is
resident on a GPU that has a slot for one now (`warm_models`); which GPU each one takes is the
estimates' walk.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from llamaswap.core.arrivals import Arrivals
from llamaswap.core.clock import NS_PER_S
from llamaswap.core.decisions import BandStats, Claim, Decision, GpuView, QueueSnapshot, RunningView, WaitingView
from llamaswap.core.dispatch import takes_nothing
from llamaswap.core.eviction import after_load, no_need, victims
from llamaswap.core.holding import IDLE, GpuHolding, resident_on
from llamaswap.core.index import Entry, Index, prune
from llamaswap.core.gpu_record import GpuRecord
from llamaswap.core.policy import Policy
from llamaswap.core.priority import Band


def rank(item: tuple[int, int, Entry], bonus: int, scale: int) -> tuple[int, int]:
    """An index item's place in the dispatch order with ``bonus`` points of swap affinity: its
    key plus the bonus, then earlier arrival (the larger, the better)."""
    return -item[0] + bonus * scale, -item[1]


def pick(index: Index, warm: Collection[str], bonus: int, taken: set[int] | None = None) -> Entry:
    """The winner among the waiting in `index` while the ``warm`` models are resident (on GPUs
    with a slot for them, `warm_models`): the best of the global top and each such model's top,
    plus the bonus where its model is resident (`rank`). One GPU is a node of one."""
    top = prune(index.all, taken)  # (`Index.top`, without its frame: this runs several times per grant)
    assert top is not None, "called with an empty queue"
    if not warm or not bonus:
        return top[2]
    # `rank`, inline: this runs several times per grant. The global top gets the bonus too
    # where its own model is loaded.
    points = bonus * index.scale
    best = top[2]
    best_key, best_seq = -top[0] + (points if best.model in warm else 0), top[1]
    # sorted: a tie between two models' tops goes the same way every run
    for model in warm if len(warm) == 1 else sorted(warm):
        favourite = index.top_of(model, taken)
        if favourite is None or favourite[2] is top[2]:
            continue
        key = -favourite[0] + points
        if key > best_key or (key == best_key and favourite[1] < best_seq):
            best_key, best_seq, best = key, favourite[1], favourite[2]
    return best


def warm_models(holdings: Sequence[GpuHolding]) -> frozenset[str]:
    """The models whose requests get the swap-affinity bonus over a node: those resident on a
    GPU that has a slot for one now. A model loaded only on full or held GPUs earns none:
    the bonus is for starting without a swap, as with one GPU, so an idle GPU's own model
    wins by it over a slightly better request whose model runs elsewhere (which would swap
    the idle GPU, then swap back: the ping-pong the bonus exists to damp)."""
    return resident_on([gpu for gpu in holdings if not takes_nothing(gpu)])


def dispatch_order(index: Index, count: int, gpus: Sequence[GpuRecord], bonus: int) -> list[tuple[Entry, int]]:
    """The order `Scheduler.next` would grant the `count` waiting requests of `index` in if
    nothing changed, with each one's affinity bonus at its turn: the same `pick` on a copy of
    the index, each simulated grant making its model the resident one. (Over several GPUs: best
    score first, with the bonus where a request's model is resident now: which GPU a grant
    would take, and so where its model becomes resident, is the estimates' walk to say, so the
    order does not guess it.)"""
    index = index.copy()
    taken: set[int] = set()
    order: list[tuple[Entry, int]] = []
    if len(gpus) > 1:
        resident_now = warm_models([gpu.holding for gpu in gpus])
        for _ in range(count):
            winner = pick(index, resident_now, bonus, taken)
            taken.add(winner.seq)
            order.append((winner, bonus if winner.model is not None and winner.model in resident_now else 0))
        return order
    residents = gpus[0].residents
    for _ in range(count):
        winner = pick(index, residents, bonus, taken)
        taken.add(winner.seq)
        order.append((winner, bonus if winner.model is not None and winner.model in residents else 0))
        if winner.model is not None and not winner.alone and winner.model not in residents:
            # A load joins the resident models, the rule's victims making room (with room for
            # one model, the resident one).
            residents = _after(residents, winner.model, gpus[0])
    return order


def _after(residents: frozenset[str], model: str, gpu: GpuRecord) -> frozenset[str]:
    """The residents once ``model`` has loaded on ``gpu`` in the simulated order: the rule's
    evictions (`eviction.victims`, by recency here: the order does not say what will wait then)
    as they would be now, else once what runs has drained (the load waits for it: with room for
    one model, the resident one goes then)."""
    holding = gpu.holding._replace(residents=residents)
    gone = victims(holding, model, no_need)
    if gone is None:
        holding = holding._replace(running=IDLE)
        gone = victims(holding, model, no_need)
    return after_load(holding, model, [eviction.model for eviction in gone or ()])


def slots_total(gpu: GpuRecord) -> int:
    """The slots `Scheduler.next` fills up to now on a GPU: those of the model its grants name,
    else of its resident model (the default when none is known)."""
    return gpu.holding.slots_in_effect


def band_stats(arrivals: Arrivals, now_ns: int) -> dict[Band, BandStats]:
    """Depth and oldest wait per band in O(1) amortised (for metrics)."""
    stats = {}
    for band in Band:
        oldest = arrivals.oldest_of(band)
        if oldest is None:
            stats[band] = BandStats(0, 0.0, None)
        else:
            oldest_wait_s = (now_ns - oldest.arrival_ns) / NS_PER_S
            stats[band] = BandStats(arrivals.depth(band), oldest_wait_s, oldest.arrival_ns)
    return stats


def snapshot(policy: Policy, gpus: Sequence[GpuRecord], index: Index, count: int, grants: Sequence[Decision],
             arrivals: Arrivals, now_ns: int, held_back: Mapping[str, tuple[str | None, ...]],
             claim: Claim | None = None) -> QueueSnapshot:
    """A read-only picture of the queue: the `count` waiting requests of `index` in dispatch
    order, the running `grants` and each GPU (with the models the best holds back there, by
    name in ``held_back``, the busy one it waits for first), and the ``claim`` in force. The
    simulated order makes it O(n log n)."""
    divisor = policy.aging_divisor_ns
    waiting = tuple(
        WaitingView(
            request_id=entry.request_id,
            position=position + 1,
            priority=entry.priority.value,
            band=entry.priority.band,
            score=entry.base + bonus + (aging := (now_ns - entry.arrival_ns) / divisor if divisor else 0.0),
            swap_affinity=bonus > 0,
            waited_s=(now_ns - entry.arrival_ns) / NS_PER_S,
            model=entry.model,
            aging=aging,
            max_tokens=entry.max_tokens,
        )
        for position, (entry, bonus) in enumerate(dispatch_order(index, count, gpus, policy.swap_affinity_bonus))
    )
    running = tuple(RunningView.of(decision, now_ns) for decision in grants)
    views = tuple(GpuView(gpu.name, tuple(sorted(gpu.residents)), len(gpu.grants), slots_total(gpu),
                          next(iter(held), None), tuple(model for model in held if model is not None))
                  for gpu in gpus for held in (held_back.get(gpu.name, ()),))
    return QueueSnapshot(policy.name, waiting, band_stats(arrivals, now_ns), running, views, claim, now_ns)

