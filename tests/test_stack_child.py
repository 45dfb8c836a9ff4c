"""`up`'s children: the parent-death signal they carry, and a stop that escalates and says so."""

from __future__ import annotations

import pathlib
import signal
import sys

import pytest
from harness import wait_for

from llamaswap.commands.up import Child

_IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "print('ready', flush=True); time.sleep(120)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_carries_sigkill_as_its_parent_death_signal(tmp_path: pathlib.Path) -> None:
    # The child asks the kernel for its own parent-death signal (PR_GET_PDEATHSIG is 2).
    probe = ("import ctypes, signal; value = ctypes.c_int(); "
             "ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0); "
             "print('pdeathsig', signal.Signals(value.value).name, flush=True)")
    child = Child("probe", [sys.executable, "-c", probe], tmp_path / "probe.log")
    assert child.process.wait(30) == 0
    assert "pdeathsig SIGKILL" in (tmp_path / "probe.log").read_text()


async def test_a_child_that_ignores_sigterm_is_killed_and_the_stop_says_so(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_path = tmp_path / "stubborn.log"
    child = Child("stubborn", [sys.executable, "-c", _IGNORES_SIGTERM], log_path)
    wait_for(lambda: "ready" in log_path.read_text(), what=f"the ready line in {log_path}")
    await child.stop(timeout_s=0.5)
    assert child.process.returncode == -signal.SIGKILL
    assert f"stubborn did not stop within 0.5 s of SIGTERM: killed (its log: {log_path})" in capsys.readouterr().err


async def test_a_child_that_stops_on_sigterm_is_not_reported(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_path = tmp_path / "polite.log"
    child = Child("polite", [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"],
                  log_path)
    wait_for(lambda: "ready" in log_path.read_text(), what=f"the ready line in {log_path}")
    await child.stop(timeout_s=30)
    assert child.process.returncode == -signal.SIGTERM
    assert "did not stop" not in capsys.readouterr().err
