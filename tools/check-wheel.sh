#!/bin/sh
# The wheel on its own: install it into a throwaway bare venv (no system site packages, so
# no PeachPy; nothing but that venv on PATH, so no linker) and generate from the CLI and
# from `import llambda`. make test runs it (once per wheel); by hand:
#
#   tools/check-wheel.sh dist/llambda-*.whl
#
# The run-time dependencies come from PyPI through pip's cache. The llambda cache starts
# empty (no kernel library, no converted model) except for the downloaded models, which
# are shared with the user's cache: the default model is a 100 MB download.
set -eu
wheel=$(realpath "$1")
prompt="The capital of France is"
cache=${LLAMBDA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llambda}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() {
    echo "check-wheel: $wheel: $*" >&2
    exit 1
}

/usr/bin/python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel" 2>"$tmp/pip.err" \
    || { cat "$tmp/pip.err" >&2; fail "pip install failed"; }
mkdir -p "$cache/models" "$tmp/cache"
ln -s "$cache/models" "$tmp/cache/models"

# From inside $tmp: python -m and -c put the working directory first on sys.path, and in
# the checkout that would import its llambda/ instead of the installed one.
cd "$tmp"
bare() {
    env -u PYTHONPATH -u LLAMBDA_KERNEL_DIR -u LLAMBDA_BACKEND -u LLAMBDA_FAMILIES \
        PATH="$tmp/venv/bin" LLAMBDA_CACHE_DIR="$tmp/cache" "$@"
}

if bare python -c "import peachpy" 2>/dev/null; then fail "the bare venv imports peachpy"; fi
if bare python -c "import shutil, sys; sys.exit(shutil.which('ld') is None)"; then fail "ld is on the bare PATH"; fi

version=$(bare llambda --version 2>&1) || fail "llambda --version failed: $version"
case $version in
    *"packaged with this installation"*) ;;
    *) fail "the packaged kernel library does not serve: $version" ;;
esac

# quiet COMMAND...: its stdout, with its stderr shown only when it fails
quiet() {
    "$@" 2>"$tmp/stderr" || { cat "$tmp/stderr" >&2; fail "failed: $*"; }
}

# The chat page `llambda serve` answers GET / with: plain files inside the package.
quiet bare python -c '
import sys
from importlib.resources import files
static = files("llambda") / "server" / "static"
missing = [name for name in ("index.html", "chat.js", "chat.css") if not (static / name).is_file()]
if missing:
    sys.exit("the chat page is not packaged: llambda/server/static/ lacks " + ", ".join(missing))
'

quiet bare llambda fetch >/dev/null
text=$(quiet bare llambda run --prompt "$prompt" --temperature 0 --max-tokens 16)
case $text in *Paris*) ;; *) fail "llambda run: no Paris in: $text" ;; esac
echo "check-wheel: llambda run: $prompt$text" | head -1

gguf=$(quiet bare llambda fetch --gguf)
quiet bare python -m llambda convert "$gguf" -o "$tmp/model.llb" --quiet >/dev/null
text=$(quiet bare python -c '
import sys
import llambda
model = llambda.load(sys.argv[1])
print("".join(model.generate(sys.argv[2], max_tokens=16, temperature=0)))
' "$tmp/model.llb" "$prompt")
case $text in *Paris*) ;; *) fail "llambda.load().generate: no Paris in: $text" ;; esac
echo "check-wheel: import llambda: $prompt$text" | head -1

# The SIGBUS guard (runtime/faults.py) runs on the handler the wheel's kernel library
# holds: without PeachPy there is nothing else to install it from.
quiet bare python -c '
import sys
from llambda.runtime import faults
if not faults.arm():
    sys.exit("no SIGBUS handler in the packaged kernel library")
'
# The issue 39 repro: the model truncated while `llambda run` generates from it ends the
# process with one line naming the file (exit status 135), as soon as the first text arrived.
cp "$tmp/model.llb" "$tmp/truncated.llb"
quiet bare python -c '
import os, subprocess, sys
model = sys.argv[1]
with subprocess.Popen(["llambda", "run", "--model", model, "--max-tokens", "100000", "--ignore-eos"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
    proc.stdout.read1(1)
    os.truncate(model, 40000000)
    _, err = proc.communicate(timeout=600)
lines = err.decode().strip().splitlines()
if proc.returncode != 135 or len(lines) != 1 or model not in lines[0]:
    sys.exit(f"a model truncated under llambda run: exit status {proc.returncode}, stderr: {err.decode()!r}")
' "$tmp/truncated.llb"
echo "check-wheel: a model truncated under llambda run ends with one line naming it"

if [ -e "$tmp/cache/kernels" ]; then fail "a kernel library or SIGBUS handler was built into the cache"; fi
echo "$version" | sed "s|^|check-wheel: |"
echo "check-wheel: $(basename "$wheel") works in a bare venv"
