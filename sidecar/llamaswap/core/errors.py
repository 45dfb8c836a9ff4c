"""The failures the scheduling core reports; the configuration and the runtime map them to key
paths and HTTP answers."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base for every failure the core reports."""


class QueueFull(SchedulerError):
    def __init__(self, depth: int, limit: int) -> None:
        super().__init__(f"queue is full: {depth} waiting, limit {limit}")
        self.depth = depth
        self.limit = limit


class UnknownRequest(SchedulerError):
    """The request is not in the state the command needs (not waiting, or not running)."""


class InvalidSlots(SchedulerError):
    """Slot settings that cannot work: fewer than one slot for a model, a negative reservation,
    or a reservation that leaves a model no slot for non-interactive work.

    ``model`` names the model whose slots are at fault; None means the default (the slots of
    every model not listed on its own). The configuration maps this to its key paths.
    """

    def __init__(self, message: str, *, model: str | None, slots: int, reserved: int) -> None:
        super().__init__(message)
        self.model = model
        self.slots = slots
        self.reserved = reserved
