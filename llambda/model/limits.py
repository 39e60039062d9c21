"""Limits checked before anything big is allocated or started: worker threads against the
CPUs this process may use, and the context's memory against the memory available.

Both fail with one line that names the option and gives the figures, instead of a
thread-start RuntimeError after seconds or a numpy MemoryError.
"""
import os
import sys

from llambda.errors import UserError

# Workers beyond the usable CPUs only time-share them (and spin at every barrier):
# more than this many per CPU is refused outright, more than one per CPU warned about.
MAX_THREADS_PER_CPU = 4


def usable_cpus():
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_thread_count(threads, source="--threads", warn=None):
    """``threads`` if it is sane for this machine; a warning on ``warn`` when it exceeds the
    usable CPUs (``warn``: a file, default stderr), a UserError when it exceeds them
    MAX_THREADS_PER_CPU times."""
    if threads is None:
        return None
    cpus = usable_cpus()
    if threads > MAX_THREADS_PER_CPU * cpus:
        raise UserError(f"{source}: {threads} worker threads for {cpus} usable CPU{'s' * (cpus != 1)} "
                        f"(at most {MAX_THREADS_PER_CPU * cpus}; more threads than CPUs only slow decoding)")
    if threads > cpus:
        print(f"llambda: warning: {source} {threads} is more than the {cpus} CPU{'s' * (cpus != 1)} this "
              "process may use: the threads will share them and decode slowly", file=warn or sys.stderr)
    return threads


def context_bytes(config, n_ctx, kv_bytes=None):
    """Bytes the context of ``n_ctx`` positions allocates: the KV cache (``kv_bytes``, default
    one f32 cache of n_ctx positions), the RoPE tables (two (base, scale) pairs at most) and
    the attention scratch."""
    kv = 2 * config.n_layer * config.n_kv_head * n_ctx * config.head_dim * 4 if kv_bytes is None else kv_bytes
    rope = 2 * 2 * n_ctx * config.head_dim * 4
    scratch = 16 * n_ctx
    return kv + rope + scratch


def available_memory():
    """Bytes of memory available to this process: /proc/meminfo's MemAvailable, bounded by
    a cgroup v2 limit; None where neither is readable."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            room = int(limit) - used
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def check_context_memory(config, n_ctx, option="--ctx", kv_bytes=None):
    """Refuse a context whose buffers cannot fit in the memory available, with the figures.
    ``kv_bytes``: the KV pool's size (every sequence's cache), when it is not one f32 context."""
    need = context_bytes(config, n_ctx, kv_bytes)
    have = available_memory()
    if have is not None and need > have:
        raise UserError(f"{option} {n_ctx if option == '--ctx' else ''}".rstrip()
                        + f": the KV cache needs {_size(need)} ({config.n_layer} layers x {config.n_kv_head} KV heads "
                        f"x {config.head_dim}, K and V, {n_ctx} positions a sequence) but {_size(have)} of memory "
                        "is available; use a smaller --ctx, --parallel or --kv-cache-mb")
    return need


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
