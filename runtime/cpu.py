"""CPU feature gate: which kernel ISAs this machine can run (via py-cpuinfo)."""
import functools

REQUIRED = {"avx2": ("avx2", "fma", "f16c")}


@functools.lru_cache(maxsize=None)
def cpu_flags():
    try:
        import cpuinfo
        return frozenset(cpuinfo.get_cpu_info().get("flags", ()))
    except Exception:      # no cpuinfo, or an exotic platform: claim nothing
        return frozenset()


def missing_flags(isa):
    """The CPU flags ``isa`` needs that this CPU lacks (empty when it can run it)."""
    return [f for f in REQUIRED[isa] if f not in cpu_flags()]


def supports(isa):
    return not missing_flags(isa)
