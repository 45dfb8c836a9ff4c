"""Counting the Python lines the scheduling core executes: a cost measure that does not depend
on the machine's speed (heap operations run in C and count nothing, so an O(log n) dispatch runs
a number of lines that does not grow with the queue; a scan over entries does)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import llamaswap.core.scheduler as scheduler_module

CORE_DIR = os.path.dirname(scheduler_module.__file__)


def core_lines(action: Callable[[], None]) -> int:
    """How many lines of llamaswap.core `action()` executes."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def global_(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(CORE_DIR) else None

    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        action()
    finally:
        sys.settrace(previous)
    return count
