"""What a request is scheduled as, and which ``models.<id>`` entry is its: the one function
(`model_key`) that the queue, the slots, the per-model priority, the learnt slots, the estimates
and the settle all key on, and its consequence for the configuration (`unmatched`, `single_model_slots`).

Where the upstream routes by name (llama-server's router, llama-swap), a request is scheduled as
the model it names, and ``models.<that name>`` is its entry. A single-model upstream serves its
one model whatever name a request gives: every request is scheduled as that one model (no swap,
the affinity bonus for all); its entry is ``models.<the name it gave>`` if there is one, else the
one model's own (``models.<the name the upstream lists>``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping


@dataclasses.dataclass(frozen=True, slots=True)
class ModelKey:
    scheduled: str | None  # the scheduler's, the estimator's and the learnt slots' key
    settings: str | None  # the models.<id> entry that applies to it; None: none does


def model_key(requested: str | None, single: str | None, configured: Collection[str]) -> ModelKey:
    """``requested`` is the name the request gives (None: none); ``single`` the key of a
    single-model upstream's one model (None: the upstream routes by name); ``configured`` the
    ids of ``models.<id>``."""
    if single is None:
        return ModelKey(requested, requested if requested in configured else None)
    if requested is not None and requested in configured:
        return ModelKey(single, requested)
    return ModelKey(single, single if single in configured else None)


def single_model_slots(single: str, per_model: Mapping[str, int]) -> dict[str, int]:
    """The slots of a single-model upstream's one model from ``models.<id>.slots`` (``per_model``),
    whatever id they are written under: every entry describes that model. Its own entry's number
    if written, else the fewest written (never more at the server than any entry allows)."""
    if not per_model:
        return {}
    return {single: per_model.get(single, min(per_model.values()))}


def unmatched(configured: Iterable[str], served: Collection[str] | None, *, by_name: bool) -> list[str]:
    """The ``models.<id>`` entries `model_key` can never name: where the upstream routes by name
    (``by_name``) and lists what it serves (``served``), an id it does not list. A single-model
    upstream matches every entry (a request that gives the id gets it)."""
    if not by_name or served is None:
        return []
    return [model_id for model_id in configured if model_id not in served]
