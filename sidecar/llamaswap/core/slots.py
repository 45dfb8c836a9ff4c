"""Slot arithmetic: how many generations of a model run at once, and how many slots are kept for
the interactive band. Which request takes a free slot is the dispatch rule's (`dispatch.py`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from llamaswap.core.errors import InvalidSlots


@dataclasses.dataclass(frozen=True, slots=True)
class Slots:
    """How many generations of the loaded model run at once, and how many of those slots are kept
    for the interactive band (priority >= ``INTERACTIVE_FLOOR``).

    ``default`` applies to every model not in ``per_model`` and to requests that name no model
    while nothing is loaded. Non-interactive requests use at most ``of(model) - reserved`` slots
    (whatever the interactive ones use), so at every moment at least ``reserved`` slots are idle
    or serve interactive work; ``reserved`` must be below every model's slots (`InvalidSlots`
    otherwise). The defaults (one slot, none reserved) are the scheduler as it was before slots
    existed.
    """

    default: int = 1
    per_model: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reserved: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_model", dict(self.per_model))  # a picture, not the caller's dict
        reserved = self.reserved
        if not _is_int(reserved) or reserved < 0:
            raise InvalidSlots(f"reserved slots must be an integer >= 0, not {reserved!r}", model=None,
                               slots=self.default, reserved=reserved)
        for model, slots in [(None, self.default), *self.per_model.items()]:
            name = "the default" if model is None else f"model {model!r}"
            if not _is_int(slots) or slots < 1:
                raise InvalidSlots(f"slots of {name} must be an integer >= 1, not {slots!r}", model=model,
                                   slots=slots, reserved=reserved)
            if reserved >= slots:
                raise InvalidSlots(f"{reserved} reserved slots leave {name} ({slots} slots) none for "
                                   "non-interactive requests: reserve fewer than its slots", model=model,
                                   slots=slots, reserved=reserved)

    @classmethod
    def fitted(cls, default: int, per_model: Mapping[str, int], reserved: int) -> Slots:
        """Slots with ``reserved`` lowered until it is below every model's slots: for slot counts
        learnt from the upstream, where refusing is no option (compare ``.reserved`` to warn)."""
        fewest = min([default, *per_model.values()])
        return cls(default, per_model, max(0, min(reserved, fewest - 1)))

    def of(self, model: str | None) -> int:
        """The slots of ``model`` (None: the default)."""
        if model is None:
            return self.default
        return self.per_model.get(model, self.default)

    @property
    def single(self) -> bool:
        """One slot for every model: the one-grant-at-a-time scheduler."""
        return self.default == 1 and all(slots == 1 for slots in self.per_model.values())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
