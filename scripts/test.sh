#!/usr/bin/env bash
# THE test command (what CI runs). Installs what the tests need (scripts/install.sh test), then:
# the protocol stub check, ruff, mypy, eslint (the page), and pytest: unit, end-to-end (real Envoy, real
# llama-server, real Prometheus) and the chart checks.
#   scripts/test.sh                   everything
#   scripts/test.sh tests/ -k fifo    pytest only, with these arguments (fast iteration)
#   scripts/test.sh --all tests/      every check, and pytest with these arguments
# Every step runs; the exit status is the first failing step's.
set -euo pipefail
cd "$(dirname "$0")/.."

all=0
pytest_args=()
for arg in "$@"; do
    if [ "$arg" = --all ]; then all=1; else pytest_args+=("$arg"); fi
done
[ "${#pytest_args[@]}" -eq 0 ] && all=1

scripts/install.sh test

first_status=0
failed=()
step() {  # step NAME COMMAND...: run it, remember the first failure, go on
    local name="$1" status=0
    shift
    echo "==> $name"
    "$@" || status=$?
    if [ "$status" -ne 0 ]; then
        failed+=("$name (exit status $status)")
        [ "$first_status" -ne 0 ] || first_status=$status
    fi
}

pytest() {
    local status=0
    .venv/bin/python -m pytest -p no:cacheprovider "$@" || status=$?
    # pytest's 5 means "no tests collected": with a selection that matched nothing, that is not a failure.
    if [ "$status" -eq 5 ]; then
        echo "no tests were collected"
        status=0
    fi
    return "$status"
}

if [ "$all" -eq 1 ]; then
    step "protocol stubs are up to date" .venv/bin/python proto/generate.py --check
    step "the chart's config schema is generated from the sidecar's" \
        .venv/bin/python charts/llamaswap/generate_schema.py --check
    step "ruff check" .venv/bin/ruff check sidecar tests e2e bench scripts charts proto conftest.py
    step "mypy (sidecar/llamaswap)" .venv/bin/mypy
    step "eslint (the page at /ui)" scripts/eslint/node_modules/.bin/eslint --config scripts/eslint/eslint.config.mjs \
        sidecar/llamaswap/ui
fi
step "pytest${pytest_args[*]:+ ${pytest_args[*]}}" pytest "${pytest_args[@]}"

if [ "${#failed[@]}" -gt 0 ]; then
    printf '==> failed: %s\n' "${failed[@]}"
    exit "$first_status"
fi
