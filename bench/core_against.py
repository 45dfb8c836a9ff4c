"""This tree's bench/core.py run against whichever llamaswap comes first on PYTHONPATH, so that an
older tree's scheduler (issue 45's parent, 68b3511, from `git archive` or a worktree) is timed by
the same benchmark. It shims the names the core changed since: `NodeTimes.of_grants` took a list
(and `LazyNodeTimes` read it late), and `Scheduler.set_residents` took `upstream=`.

Run: PYTHONPATH=OLD/sidecar .venv/bin/python bench/core_against.py [bench/core.py's flags]
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

from llamaswap.core import estimate_node
from llamaswap.core.scheduler import Scheduler


def _load_core():
    path = pathlib.Path(__file__).with_name("core.py")
    spec = importlib.util.spec_from_file_location("bench_core", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_core"] = module
    spec.loader.exec_module(module)
    return module


def _shim_older_core(core) -> None:
    if not hasattr(estimate_node, "LazyNodeTimes"):
        return  # this tree's own core: nothing to shim
    older, lazy = estimate_node.NodeTimes, estimate_node.LazyNodeTimes

    class NodeTimes:
        @staticmethod
        def of_grants(grants, now_ns, figures):
            return lazy(lambda: older.of_grants(grants(), now_ns, figures), figures)

    core.NodeTimes = NodeTimes
    set_residents = Scheduler.set_residents

    def set_residents_of_gpu(self, models, *, as_of, gpu=None):
        return set_residents(self, models, as_of=as_of, upstream=gpu)

    Scheduler.set_residents = set_residents_of_gpu


def main(argv: list[str]) -> int:
    core = _load_core()
    _shim_older_core(core)
    print(f"core_against: the scheduler of {estimate_node.__file__}", flush=True)
    return core.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
