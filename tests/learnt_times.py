"""Fixed learnt times for the property tests that play a node against a brute-force reference
(tests/test_node.py, tests/test_resident_properties.py): one value handed to both sides."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hypothesis import strategies as st

SECONDS = (0.5, 2.0, 10.0, 30.0)


@dataclasses.dataclass(frozen=True)
class Times:
    """Fixed learnt times per GPU (and per model for a load), handed to both."""

    slot_free: dict[str, float]
    drained: dict[str, float]
    swap: dict[tuple[str | None, str], float]

    def slot_free_in_s(self, gpu: str) -> float:
        return self.slot_free[gpu]

    def drained_in_s(self, gpu: str) -> float:
        return self.drained[gpu]

    def swap_s(self, model: str | None, gpu: str) -> float:
        return self.swap[model, gpu]


def times_for(names: Sequence[str], models: Sequence[str | None], *,
              unknown_in_3: int) -> st.SearchStrategy[Times | None]:
    """Times for these GPUs and models, or None (nothing learnt yet) in ``unknown_in_3`` draws of 3."""
    seconds = st.sampled_from(SECONDS)
    per_gpu = st.fixed_dictionaries({name: seconds for name in names})
    per_load = st.fixed_dictionaries({(model, name): seconds for model in models for name in names})
    known = st.builds(Times, per_gpu, per_gpu, per_load)
    return st.one_of(*([st.none()] * unknown_in_3 + [known] * (3 - unknown_in_3)))
