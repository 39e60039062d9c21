"""Kernel generators (build time only: imports PeachPy).

One module per kernel family, each with ``emit(isa) -> list[Kernel]``.
``build.py`` turns every family into one ELF object and one shared library.
Nothing at run time imports this package unless the library must be rebuilt.
"""
