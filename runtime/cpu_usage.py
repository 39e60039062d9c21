"""How much of the CPUs a pool's workers are pinned to other work takes (Linux /proc).

    before = snapshot(cpus, thread_ids, [1])    # worker 1: (others' busy ticks of its CPU, total)
    ...
    share = others_share(before, snapshot(cpus, thread_ids, [1]))     # 0..1, or None

A CPU's busy ticks (/proc/stat: everything but idle and iowait, steal included: a core the
hypervisor gives another guest is not ours either) minus the ticks of the worker pinned to it
(/proc/self/task/<tid>/stat): what other processes, and this process's unpinned threads, took
of that core. Where /proc cannot be read, or a worker is not pinned, there is no snapshot.
"""

STAT = "/proc/stat"


def cpu_ticks(path=STAT):
    """``{cpu: (busy, total)}`` in clock ticks since boot, or None where it cannot be read."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            ticks = [int(x) for x in rest.split()]
            cpu = int(name[3:])
        except ValueError:
            continue
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        total = sum(ticks[:8])
        out[cpu] = (total - idle, total)
    return out or None


def thread_ticks(thread_id):
    """User + system clock ticks of this process's thread ``thread_id``, or None."""
    try:
        with open(f"/proc/self/task/{thread_id}/stat") as f:
            text = f.read()
        fields = text[text.rindex(")") + 2:].split()
        return int(fields[11]) + int(fields[12])          # utime, stime (fields 14, 15 of stat)
    except (OSError, ValueError, IndexError):
        return None


def snapshot(cpus, thread_ids, workers):
    """``{worker: (ticks others kept its CPU busy, total ticks)}`` since boot for ``workers``,
    or None if any of them is unpinned, unstarted or unreadable."""
    ticks = cpu_ticks()
    if ticks is None:
        return None
    out = {}
    for w in workers:
        cpu, tid = cpus[w], thread_ids[w]
        own = None if tid is None else thread_ticks(tid)
        if cpu is None or cpu not in ticks or own is None:
            return None
        busy, total = ticks[cpu]
        out[w] = (busy - own, total)
    return out


def others_share(before, after):
    """The share of the time between two snapshots (of the same workers) that other work kept
    their CPUs busy, or None without both."""
    if before is None or after is None or before.keys() != after.keys():
        return None
    busy = sum(after[w][0] - before[w][0] for w in after)
    total = sum(after[w][1] - before[w][1] for w in after)
    return busy / total if total > 0 else None
