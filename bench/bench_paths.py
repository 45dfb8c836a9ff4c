"""Where the benchmarks find the end-to-end harness: imported first by the modules that use it."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "e2e") not in sys.path:
    sys.path.insert(0, str(ROOT / "e2e"))
