#!/usr/bin/env python3
"""Kernel regeneration tool.

    tools/regen.py              rebuild if stale (one line per build job), print the manifest
    tools/regen.py --force      rebuild even if current, every object too
    tools/regen.py --quiet      rebuild if stale, print nothing
    tools/regen.py --jobs N     N build processes at a time (default: one per CPU)
    tools/regen.py --disasm SYM disassemble one kernel (objdump)
"""
import argparse
import shutil
import subprocess
import sys

from llambda.codegen import build
from llambda.runtime import library


def _positive(text):
    """--jobs N: a whole number of processes, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--force", action="store_true", help="rebuild even if the library is current")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    p.add_argument("--jobs", type=_positive, metavar="N", help="build processes at a time (default: one per CPU)")
    p.add_argument("--disasm", metavar="SYMBOL", help="disassemble one kernel")
    args = p.parse_args(argv)

    if args.force:
        forget_build()
    directory = library.ensure_built(verbose=not args.quiet, jobs=args.jobs)
    lib = library.KernelLibrary(directory)
    if args.disasm:
        if args.disasm not in lib.manifest:
            sys.exit(f"regen: no kernel named {args.disasm}; known: {', '.join(sorted(lib.manifest))}")
        out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={args.disasm}",
                              str(lib.path)], check=True, capture_output=True, text=True).stdout
        print(out)
        return
    if args.quiet:
        return
    print(f"{lib.path}")
    print(f"{'symbol':48} {'family':12} {'isa':6} {'tile':10} {'bytes':>7}")
    for k in sorted(lib.manifest.values(), key=lambda k: (k["family"], k["symbol"])):
        print(f"{k['symbol']:48} {k['family']:12} {k['isa']:6} {k['tile']:10} {k['code_bytes']:7d}")
    print(f"{len(lib.manifest)} kernels, {sum(k['code_bytes'] for k in lib.manifest.values())} bytes of code")


def forget_build():
    """The current library and the objects it is linked from, removed: all built again."""
    shutil.rmtree(library.library_dir(), ignore_errors=True)
    objects = library.objects_dir()
    for job in build.plan():
        for suffix in (".o", ".json"):
            (objects / f"{job.stem}{suffix}").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
