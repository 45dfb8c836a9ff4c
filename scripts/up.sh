#!/usr/bin/env bash
# Installs llamaswap with llama-server and a small real model, then runs the whole stack:
#   scripts/up.sh                 built-in default (llama-server + gemma3 270M on CPU or GPU)
#   scripts/up.sh -c my.yaml      your own configuration (e.g. an existing llama-server)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh demo
exec .venv/bin/llamaswap up "$@"
