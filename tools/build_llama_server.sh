#!/bin/sh
# Build llama.cpp's own `llama-server` for `llambda bench --serve` to compare against.
# Optional: no test needs it. It builds the llama.cpp that the llama-cpp-python 0.3.36 sdist
# vendors, with the same ISA as llambda targets (AVX2/FMA/F16C, no -march=native), and without
# curl/OpenSSL so that it needs no extra Debian packages.
#
#   sh tools/build_llama_server.sh [LLAMA_CPP_SOURCE] [BUILD_DIR]
#
# Defaults: the sdist, downloaded from PyPI and unpacked into <cache>/llama-server/ (the
# llambda cache: $LLAMBDA_CACHE_DIR, else ~/.cache/llambda), and a build folder there, where
# `llambda bench --serve` looks first. It takes about 10 minutes on 2 cores. The binary ends
# up in BUILD_DIR/bin/llama-server; another one is passed as
#   llambda bench --serve --llama-server BUILD_DIR/bin/llama-server
set -eu
HOME_CACHE=${LLAMBDA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llambda}/llama-server
SDIST=llama_cpp_python-0.3.36
SRC=${1:-$HOME_CACHE/$SDIST/vendor/llama.cpp}
BUILD=${2:-$HOME_CACHE/build}
if [ $# -lt 1 ] && [ ! -f "$SRC/CMakeLists.txt" ]; then
    mkdir -p "$HOME_CACHE"
    python3 -m pip download --no-deps --no-binary llama-cpp-python --quiet -d "$HOME_CACHE" llama-cpp-python==0.3.36
    tar -xzf "$HOME_CACHE/$SDIST.tar.gz" -C "$HOME_CACHE"
fi
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
