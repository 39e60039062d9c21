#!/bin/sh
# Build llama.cpp's own `llama-server` for `llambda bench --serve` to compare against.
# Optional: no test needs it. It builds the llama.cpp that the llama-cpp-python 0.3.36 sdist
# vendors, with the same ISA as llambda targets (AVX2/FMA/F16C, no -march=native), and without
# curl/OpenSSL so that it needs no extra Debian packages.
#
#   sh tools/build_llama_server.sh [LLAMA_CPP_SOURCE] [BUILD_DIR]
#
# Defaults: the sdist unpacked in /work/dl and a build folder beside it. It takes about
# 10 minutes on 2 cores. The binary ends up in BUILD_DIR/bin/llama-server; pass it to
#   llambda bench --serve --llama-server BUILD_DIR/bin/llama-server
set -eu
SRC=${1:-/work/dl/llama_cpp_python-0.3.36/vendor/llama.cpp}
BUILD=${2:-/work/dl/llama-server-build}
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    echo "no llama.cpp source at $SRC (unpack the llama-cpp-python sdist: pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36)" >&2
    exit 1
fi
if ! command -v cmake >/dev/null 2>&1 || ! command -v ninja >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake ninja-build >/dev/null
    else
        echo "needs cmake and ninja:  sudo apt-get install -y cmake ninja-build" >&2
        exit 1
    fi
fi
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
cmake --build "$BUILD" --target llama-server
echo "$BUILD/bin/llama-server"
