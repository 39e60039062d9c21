#!/bin/sh
# Make sure the Debian packages llambda needs are present.
#   python3-peachpy  generates the kernels (PyPI's "peachpy" is a broken 2013 release)
#   binutils         ld links the kernel objects into one shared library; objdump disassembles
#   python3-venv     the project's virtual environment
# As root we install what is missing; otherwise we name it and stop.
# Optional, for the chat page's browser test (tests/server/test_chat_page.py skips without them):
#   chromium, chromium-driver  installed as root when missing; a failure only warns
set -eu
missing=""
/usr/bin/python3 -c "import peachpy" 2>/dev/null || missing="$missing python3-peachpy"
command -v ld >/dev/null 2>&1 && command -v objdump >/dev/null 2>&1 || missing="$missing binutils"
/usr/bin/python3 -c "import ensurepip, venv" 2>/dev/null || missing="$missing python3-venv"
optional=""
command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || optional=" chromium chromium-driver"
[ "$(id -u)" = 0 ] || optional=""
[ -z "$missing$optional" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    echo "installing Debian packages:$missing$optional" >&2
    apt-get update -qq || [ -z "$missing" ]          # offline: only the optional ones are lost
    [ -z "$missing" ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    [ -z "$optional" ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $optional >/dev/null \
        || echo "could not install$optional: the chat page's browser test will skip" >&2
else
    echo "llambda needs these Debian packages:$missing" >&2
    echo "install them with:  sudo apt-get update && sudo apt-get install -y$missing" >&2
    exit 1
fi
