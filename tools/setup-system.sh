#!/bin/sh
# Make sure the Debian packages llambda needs are present.
#   python3-peachpy  generates the kernels (PyPI's "peachpy" is a broken 2013 release)
#   binutils         ld links the kernel objects into one shared library; objdump disassembles
#   python3-venv     the project's virtual environment
# As root we install what is missing; otherwise we name it and stop.
set -eu
missing=""
/usr/bin/python3 -c "import peachpy" 2>/dev/null || missing="$missing python3-peachpy"
command -v ld >/dev/null 2>&1 && command -v objdump >/dev/null 2>&1 || missing="$missing binutils"
/usr/bin/python3 -c "import ensurepip, venv" 2>/dev/null || missing="$missing python3-venv"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    echo "installing Debian packages:$missing" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
else
    echo "llambda needs these Debian packages:$missing" >&2
    echo "install them with:  sudo apt-get update && sudo apt-get install -y$missing" >&2
    exit 1
fi
