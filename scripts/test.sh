#!/usr/bin/env bash
# Installs everything the tests need, then runs them all: unit, end-to-end (real Envoy, real
# llama-server, real Prometheus), the chart checks, and the protocol stub check.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
echo "==> protocol stubs are up to date"
.venv/bin/python proto/generate.py --check
echo "==> tests"
set +e
.venv/bin/python -m pytest -p no:cacheprovider "$@"
status=$?
set -e
# pytest's 5 means "no tests collected": with a selection that matched nothing, that is not a failure.
if [ "$status" -eq 5 ]; then
    echo "no tests were collected"
    exit 0
fi
exit "$status"
