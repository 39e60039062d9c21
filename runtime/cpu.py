"""CPU feature gate: which kernel ISAs this machine can run (via py-cpuinfo)."""
import functools

REQUIRED = {"avx2": ("avx2", "fma", "f16c"),
            "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl")}


@functools.lru_cache(maxsize=None)
def cpu_flags():
    """The CPU's feature flags. Linux's /proc/cpuinfo answers in a millisecond;
    py-cpuinfo (which runs a subprocess, ~1 s) covers everything else."""
    flags = frozenset(_proc_cpuinfo("flags").split())
    if flags:
        return flags
    try:
        import cpuinfo
        return frozenset(cpuinfo.get_cpu_info().get("flags", ()))
    except Exception:      # no cpuinfo, or an exotic platform: claim nothing
        return frozenset()


def _proc_cpuinfo(field):
    """The value of /proc/cpuinfo's first ``field`` line (the first CPU's), or ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def vendor():
    """The CPU's vendor string as /proc/cpuinfo gives it ("GenuineIntel", "AuthenticAMD"), or ""."""
    return _proc_cpuinfo("vendor_id")


def missing_flags(isa):
    """The CPU flags ``isa`` needs that this CPU lacks (empty when it can run it)."""
    return [f for f in REQUIRED[isa] if f not in cpu_flags()]


def supports(isa):
    return not missing_flags(isa)
