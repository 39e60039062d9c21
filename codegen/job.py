"""One build job, in a process of its own: one family's kernels for one ISA (or one part of
them) -> an ELF object and its part of the manifest.

    python codegen/job.py CODEGEN_DIR FAMILY ISA PART OUT_STEM       (PART "-": all of them)

writes OUT_STEM.o, then OUT_STEM.json (the manifest entries, the job's seconds and peak RSS),
each under a temporary name renamed into place: a job is done when its .json exists, and a
killed one leaves nothing under the real names. A process per job bounds the memory PeachPy
holds to one job's kernels and gives it all back when the job ends.

``write_object`` is also what ``build.link`` assembles with.
"""
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

# PeachPy's liveness analysis recurses once per basic block along a path: the larger kernels
# (paged attention on f16/q8_0 arenas) need more frames than Python's default.
RECURSION_LIMIT = 20000
PACKAGE = "_llambda_codegen"        # codegen/ loaded by its path: nothing of llambda is imported


def load_codegen(here):
    """codegen/ at ``here`` as the package PACKAGE (its modules import each other relatively)."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(PACKAGE, Path(here) / "__init__.py",
                                                  submodule_search_locations=[str(here)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    return package


def keep_available_registers_only_where_read():
    """PeachPy's analysis records on every instruction the registers available before it: a
    dict of every register written on some path to it, so a kernel with thousands of virtual
    registers and instructions holds millions of entries (3.6 GB and 40 s for one AVX-512
    attention kernel). Only LOAD.ARGUMENT reads that dict again (ABIFunction asks whether the
    argument's register is still free); on every other instruction it is dropped as it is set.
    The code and data emitted are the same bytes."""
    from peachpy.x86_64.instructions import Instruction
    from peachpy.x86_64.pseudo import LOAD
    if isinstance(Instruction.__dict__.get("_available_registers"), property):
        return

    def get(instruction):
        return instruction.__dict__.get("_kept_available_registers", {})

    def set_(instruction, registers):
        if registers and not isinstance(instruction, LOAD.ARGUMENT):
            registers = {}
        instruction.__dict__["_kept_available_registers"] = registers
    Instruction._available_registers = property(get, set_)


def _encode_once(function):
    """Finalize ``function`` and encode it once: ELFWriter.add_function encodes what it is
    given again, so the encoding is cached on the finalized function; returns both."""
    from peachpy.x86_64 import abi
    finalized = function.finalize(abi.system_v_x86_64_abi)
    encoded = finalized.encode()
    finalized.encode = lambda: encoded
    return finalized, encoded


def write_object(kernels, path):
    """Assemble ``kernels`` (common.Kernel, or bare PeachPy functions) into the ELF object
    ``path``; returns the manifest entries. Takes the kernels out of the list as it goes, so
    each function's instructions and liveness sets are freed once it is encoded."""
    from peachpy.x86_64 import abi
    import peachpy.writer
    entries = []
    with peachpy.writer.ELFWriter(str(path), abi.system_v_x86_64_abi) as writer:
        while kernels:
            kernel = kernels.pop(0)
            function = getattr(kernel, "function", kernel)
            finalized, encoded = _encode_once(function)
            writer.add_function(finalized)
            del function, finalized
            if hasattr(kernel, "family"):
                entries.append(dict(symbol=kernel.symbol, family=kernel.family, isa=kernel.isa, tile=kernel.tile,
                                    args=[list(a) for a in kernel.args],
                                    code_bytes=len(encoded.code_section.content)))
            del kernel, encoded
    return entries


def peak_rss_kib():
    """This process's peak resident set (VmHWM), in KiB; 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _replace_atomically(write, path):
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run(here, family, isa, part, stem):
    started = time.monotonic()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))
    keep_available_registers_only_where_read()
    package = load_codegen(here)
    module = importlib.import_module(f"{package.__name__}.{family}")
    kernels = module.emit(isa) if part is None else module.emit(isa, part)
    entries = []
    _replace_atomically(lambda tmp: entries.extend(write_object(kernels, tmp)), f"{stem}.o")
    record = dict(kernels=entries, seconds=round(time.monotonic() - started, 2), peak_rss_kib=peak_rss_kib())
    _replace_atomically(lambda tmp: tmp.write_text(json.dumps(record, indent=1)), f"{stem}.json")


if __name__ == "__main__":
    # Run as a script, Python put codegen/ itself first on the path: its modules must not
    # shadow anything under their bare names.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    here_, family_, isa_, part_, stem_ = sys.argv[1:6]
    run(here_, family_, isa_, None if part_ == "-" else part_, stem_)
