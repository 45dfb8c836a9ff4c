"""The worst priority inversion of a simulation.

Definition. The inversion time of a request A is the GPU time spent, while A waited, on
requests of lower priority that arrived after A:

    inversion(A) = sum over grants G with priority(G) < priority(A), arrival(G) after arrival(A)
                   and grant(G) before A left the queue, of the part of G's hold
                   [grant(G), release(G)) that falls before A left the queue.

"Priority" is the one the scheduler ordered by (fifo: the header's plus the model's); "after"
is arrival order (ties by file order); A leaves the queue when granted, when its client gives
up, when it expires or (at once) when it is rejected. The worst inversion is the request with
the largest inversion time (the earliest to leave the queue on a tie); none when every
inversion time is 0. Non-preemption alone does not count: a lower-priority request that was
already running, or arrived earlier, is not an inversion. With serial settings an inversion
comes from swap affinity (a later, lower request with the loaded model went first). A Batch API
line stopped and resumed (`simulate --preempt`) holds the GPU part by part, each part from its
grant to its stop (the last to its release).

Computed in O(n log n): sweeping the grants and departures in time order, each priority level
keeps a Fenwick tree over its requests in arrival order; a grant adds its hold to the prefix of
every higher level that arrived before it, and a departure reads its own entry.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from llamaswap.simulate.results import Inversion, Result


class _Level:
    """The requests of one priority, in arrival order: prefix add, point read."""

    __slots__ = ("indices", "tree", "oldest")

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.tree: list[int] = []
        self.oldest = 0  # first position that has not left the queue

    def add_prefix(self, count: int, value: int) -> None:
        # Entry p is the sum over positions >= p of the adds made "at" them: a prefix add of
        # [0, count) is an add at count - 1, stored reversed so that the read is a prefix sum.
        tree, size = self.tree, len(self.indices)
        slot = size - count + 1
        while slot <= size:
            tree[slot] += value
            slot += slot & -slot

    def read(self, position: int) -> int:
        tree = self.tree
        slot = len(self.indices) - position
        total = 0
        while slot > 0:
            total += tree[slot]
            slot -= slot & -slot
        return total


def worst_inversion(results: Sequence[Result]) -> Inversion | None:
    levels: dict[int, _Level] = {}
    position = [0] * len(results)
    # (time, 0 leave / 1 grant, index, the grant's release); leaves first
    events: list[tuple[int, int, int, int]] = []
    for index, result in enumerate(results):
        level = levels.get(result.base)
        if level is None:
            level = levels[result.base] = _Level()
        position[index] = len(level.indices)
        level.indices.append(index)
        events.append((result.end_ns, 0, index, 0))
        if result.parts:  # a stopped line: each part holds the GPU from its grant to its stop
            events += [(start, 1, index, end) for start, end in result.held()]
        elif result.start_ns is not None:
            events.append((result.start_ns, 1, index, result.release_ns))  # type: ignore[arg-type]
    if not events:
        return None
    for level in levels.values():
        level.tree = [0] * (len(level.indices) + 1)
    values = sorted(levels)
    ordered = [levels[v] for v in values]
    left = [False] * len(results)
    events.sort()

    worst_ns, worst = 0, -1
    running = -1  # the last grant: the one that may be holding the GPU as someone leaves
    running_end = 0  # its release
    for time, kind, index, end in events:
        result = results[index]
        if kind == 1:
            hold = end - time
            if hold <= 0:  # nothing to count; and the grant after it, at the same instant, holds the GPU
                continue
            running, running_end = index, end
            for level in ordered[bisect.bisect_right(values, result.base):]:
                oldest = level.oldest
                if oldest < len(level.indices) and level.indices[oldest] < index:
                    level.add_prefix(bisect.bisect_left(level.indices, index, oldest), hold)
            continue
        level = levels[result.base]
        inverted = level.read(position[index])
        if result.start_ns is None and running > index:
            holder = results[running]
            if holder.base < result.base and running_end > time:
                inverted -= running_end - time  # it left while that one still ran
        if inverted > worst_ns:
            worst_ns, worst = inverted, index
        left[index] = True
        oldest, indices = level.oldest, level.indices
        while oldest < len(indices) and left[indices[oldest]]:
            oldest += 1
        level.oldest = oldest
    if worst < 0:
        return None
    result = results[worst]
    request = result.request
    return Inversion(request.record.request_id, request.priority.band.value, request.priority.value,
                     worst_ns / 1e9, result.outcome.value)
