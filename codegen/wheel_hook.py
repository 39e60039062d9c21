"""The setuptools commands that put the kernel library into the wheel (build time only).

pyproject.toml names them in ``[tool.setuptools.cmdclass]``; setuptools loads this file
by its path, before anything is installed, so it imports nothing from llambda.

* ``build_py`` copies the modules as usual, then builds the kernel library from the
  copied generators into ``llambda/runtime/kernels/`` (``libllambda.so``, its manifest
  and the source key it was built from; runtime/faults.py's SIGBUS handler is one of its
  functions, codegen/sigbus.py). runtime/library.py uses the library when that key is
  the key of the generators installed beside it. An editable install skips this: a
  checkout builds into its own build/kernels/ on first use.
* ``bdist_wheel`` tags the wheel ``py3-none-<platform>``: Python modules plus one
  x86-64 shared library that links against nothing, so any CPython 3 on the platform
  runs it, but only on that platform.

The build needs PeachPy (Debian's python3-peachpy), numpy (codegen/contract.py) and
binutils (``ld``, ``strip``). An isolated build environment cannot see Debian's PeachPy:
build with ``python -m build --no-isolation`` from a Python that imports peachpy and has
``build`` and setuptools >= 70.1 (``make wheel`` does).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
from setuptools.command.build_py import build_py as _build_py
from setuptools.errors import SetupError

# Where runtime/library.py looks for it (PACKAGED_DIR), inside the build tree.
KERNELS = ("llambda", "runtime", "kernels")

# Run in a fresh interpreter: the copied codegen/ imported as a package of its own
# (under a private name, so no module of llambda shadows one of the standard library),
# and nothing else of llambda imported. $LLAMBDA_WHEEL_KERNELS names a library already
# built (make wheel passes the one make kernels built): taken when its recorded source
# key is the key of these generators, which makes it the same bytes a build would give.
BUILD_SCRIPT = """
import importlib, importlib.util, json, os, shutil, subprocess, sys, tempfile
codegen, out = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("_llambda_codegen", codegen + "/__init__.py",
                                              submodule_search_locations=[codegen])
sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules[spec.name])
build = importlib.import_module(spec.name + ".build")
source = os.environ.get("LLAMBDA_WHEEL_KERNELS")
if source:
    try:
        recorded = json.load(open(os.path.join(source, build.KEY_NAME))).get("key")
    except (OSError, ValueError):
        recorded = None
    if recorded != build.source_key():
        sys.exit(f"llambda wheel: LLAMBDA_WHEEL_KERNELS={source} holds no library of these generators "
                 f"(source key {recorded}, these give {build.source_key()})")
tmp = tempfile.TemporaryDirectory()
if not source:
    try:
        import peachpy  # noqa: F401
    except ImportError:
        sys.exit("llambda wheel: building the kernel library needs PeachPy, which " + sys.executable
                 + " cannot import. Install Debian's python3-peachpy and build with a Python that sees it:"
                 + " python -m build --no-isolation (make wheel does).")
    source = os.path.join(tmp.name, "kernels")
    build.build(source)             # every family in a process of its own (codegen/job.py)
os.makedirs(out)
for name in (build.LIBRARY_NAME, build.MANIFEST_NAME, build.KEY_NAME):   # not the object file
    shutil.copy(os.path.join(source, name), out)
tmp.cleanup()
# PeachPy numbers each function's constants (<function>.__local<N>) in an order that changes
# from run to run; code and data do not. Without those local symbols every build of the
# same generators gives the same bytes, so the sdist's wheel is the checkout's.
subprocess.run(["strip", "--discard-all", os.path.join(out, build.LIBRARY_NAME)], check=True)
"""

class build_py(_build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        out = Path(self.build_lib, *KERNELS)
        shutil.rmtree(out, ignore_errors=True)
        # A wheel ships every family: a developer's LLAMBDA_FAMILIES restriction stays out.
        env = {k: v for k, v in os.environ.items() if k != "LLAMBDA_FAMILIES"}
        codegen = Path(self.build_lib, "llambda", "codegen")
        result = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, str(codegen), str(out)], env=env)
        if result.returncode != 0:
            raise SetupError(f"building the kernel library into {out} failed (exit status {result.returncode})")

    def get_outputs(self, include_bytecode=True):
        out = Path(self.build_lib, *KERNELS)
        extra = [str(p) for p in sorted(out.iterdir())] if out.is_dir() else []
        return super().get_outputs(include_bytecode) + extra


class bdist_wheel(_bdist_wheel):
    def finalize_options(self):
        # Not pure: it holds one platform's machine code. Told so, bdist_wheel puts every
        # file at the wheel's root (platlib) instead of under .data/purelib.
        self.distribution.has_ext_modules = lambda: True
        super().finalize_options()

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform
