"""The one build driver: every kernel family -> ELF objects -> one shared library.

    key = source_key()                    # hash of the generators (+ PeachPy version)
    build(directory, objects=..., jobs=N) # writes libllambda.so, manifest.json and source_key.json

A build is a list of jobs, one per family and ISA (a family's ``PARTS`` cut it finer), each
run by codegen/job.py in a process of its own, ``jobs`` at a time. A job's object is kept
in ``objects`` under a key of the sources it is built from (codegen/sources.py), so a
changed generator rebuilds only its own objects and its importers', and a killed build
resumes where it stopped. Then one ``ld -shared`` links every object.

``source_key`` needs no PeachPy, so the runtime can tell whether its library is current
without importing the generators. ``build`` writes into a temporary directory and renames
it into place: two processes building at once both end with a complete library, never a
half-written one.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

from . import sources

HERE = Path(__file__).resolve().parent
LIBRARY_NAME = "libllambda.so"
MANIFEST_NAME = "manifest.json"
KEY_NAME = "source_key.json"        # {"key": ..., "peachpy": the version that built it}
ALL_ISAS = ("avx2", "avx512")


def family_names():
    """Every module or package of codegen/ that defines ``emit`` is a kernel family.

    ``LLAMBDA_FAMILIES=a,b`` restricts the build to those (a developer working
    on one family need not build the others)."""
    names = [family.name for family in sources.families(HERE)]
    only = os.environ.get("LLAMBDA_FAMILIES")
    if only:
        names = [n for n in names if n in only.split(",")]
    return names


def peachpy_version():
    """The installed PeachPy's version, or None (a runtime without PeachPy)."""
    try:
        from importlib.metadata import version
        return version("peachpy")
    except Exception:
        return None


def source_key(peachpy=None):
    """Identifies the library the current generators produce with PeachPy version ``peachpy``
    (default: the installed one). A packaged library records the version that built it, so
    a runtime without PeachPy can still tell whether it matches the generators beside it."""
    return sources.library_key(HERE, family_names(), peachpy or peachpy_version())


class Job(NamedTuple):
    family: str
    isa: str
    part: str                       # None: the family's whole ISA
    key: str

    @property
    def stem(self):
        """The job's files in the object cache, ``<stem>.o`` and ``<stem>.json``."""
        return "-".join(filter(None, (self.family, self.isa, self.part, self.key)))

    @property
    def label(self):
        return " ".join(filter(None, (self.family, self.isa, self.part)))


def plan(isas=ALL_ISAS):
    """Every job of a build, in manifest order: families by name, then ISA, then part."""
    peachpy = peachpy_version()
    chosen = set(family_names())
    jobs = []
    for family in sources.families(HERE):
        if family.name not in chosen:
            continue
        for isa in (i for i in isas if i in family.isas):
            for part in family.parts.get(isa, (None,)):
                jobs.append(Job(family.name, isa, part, sources.job_key(HERE, family.name, isa, part, peachpy)))
    return jobs


def is_done(job, objects):
    return (objects / f"{job.stem}.json").is_file() and (objects / f"{job.stem}.o").is_file()


def _run_job(job, objects):
    """Run one job in a fresh interpreter; its record (kernels, seconds, peak RSS)."""
    command = [sys.executable, str(HERE / "job.py"), str(HERE), job.family, job.isa, job.part or "-",
               str(objects / job.stem)]
    result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-12:])
        raise RuntimeError(f"kernel build job {job.label} failed (exit status {result.returncode}):\n{tail}")
    return json.loads((objects / f"{job.stem}.json").read_text())


def _order_for_cores(jobs, objects):
    """Longest first, by the seconds a previous build of the same job took (another key
    of it), else by its family's size: the longest jobs must not start last."""
    def cost(job):
        for previous in objects.glob(f"{job.family}-{job.isa}{'-' + job.part if job.part else ''}-*.json"):
            try:
                return json.loads(previous.read_text())["seconds"]
            except (OSError, ValueError, KeyError):
                pass
        return sum(p.stat().st_size for p in sources.module_files(HERE, job.family)) / 1e4     # ~ seconds
    return sorted(jobs, key=cost, reverse=True)


def run_jobs(jobs, objects, workers=None, verbose=False):
    """Build every job whose object is not in ``objects`` yet, ``workers`` at a time
    (default: the CPUs this process may run on). Returns the records of those built."""
    todo = [job for job in jobs if not is_done(job, objects)]
    if verbose and len(todo) < len(jobs):
        print(f"  {len(jobs) - len(todo)} of {len(jobs)} kernel objects reused", flush=True)
    if not todo:
        return {}
    workers = workers or len(os.sched_getaffinity(0))
    records = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_run_job, job, objects): job for job in _order_for_cores(todo, objects)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                job = futures[future]
                if future.exception() is not None:
                    for other in pending:       # the jobs running finish (their objects are kept)
                        other.cancel()
                    raise future.exception()
                records[job] = future.result()
                if verbose:
                    record = records[job]
                    print(f"  {job.label:34} {record['seconds']:6.1f} s  {record['peak_rss_kib'] / 1024:6.0f} MiB",
                          flush=True)
    return records


def link(functions, obj, library):
    """Assemble PeachPy ``functions`` into the ELF object ``obj`` and link it as the shared
    library ``library`` (a one-off library: tests of single functions)."""
    from .job import write_object
    write_object(list(functions), obj)
    link_objects([obj], library)


def link_objects(objects, library):
    subprocess.run(["ld", "-shared", "-z", "noexecstack", "-o", str(library), *map(str, objects)], check=True)


def _manifest(jobs, objects):
    manifest = [entry for job in jobs for entry in json.loads((objects / f"{job.stem}.json").read_text())["kernels"]]
    seen = set()
    for entry in manifest:
        if entry["symbol"] in seen:
            raise RuntimeError(f"kernel symbol emitted twice: {entry['symbol']}")
        seen.add(entry["symbol"])
    return manifest


def build(directory, isas=ALL_ISAS, objects=None, jobs=None, verbose=False):
    """Generate, assemble and link the kernel library into ``directory``, reusing the
    objects in ``objects`` (default: none kept, everything built here).

    Returns the manifest (a list of dicts, one per kernel)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=directory.parent))
    try:
        objects = Path(objects) if objects is not None else tmp / "objects"
        objects.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        planned = plan(isas)
        run_jobs(planned, objects, jobs, verbose)
        link_objects([objects / f"{job.stem}.o" for job in planned], tmp / LIBRARY_NAME)
        manifest = _manifest(planned, objects)
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
        (tmp / KEY_NAME).write_text(json.dumps({"key": source_key(), "peachpy": peachpy_version()}))
        shutil.rmtree(tmp / "objects", ignore_errors=True)
        _rename_into_place(tmp, directory)
        if verbose:
            print(f"  {len(manifest)} kernels in {time.monotonic() - started:.1f} s: {directory / LIBRARY_NAME}",
                  flush=True)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rename_into_place(tmp, directory):
    try:
        os.rename(tmp, directory)
    except OSError:
        if not (directory / LIBRARY_NAME).exists():
            raise
        shutil.rmtree(tmp)      # somebody else finished the same build first


def prune(objects, keep):
    """Keep the ``keep`` newest objects of each job (other keys of it: earlier sources) and
    drop the temporary files a killed job left an hour or more ago."""
    by_job = {}
    for record in objects.glob("*.json"):
        job_name = record.stem.rsplit("-", 1)[0]
        by_job.setdefault(job_name, []).append(record)
    for records in by_job.values():
        records.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for record in records[keep:]:
            record.with_suffix(".o").unlink(missing_ok=True)
            record.unlink(missing_ok=True)
    hour_ago = time.time() - 3600
    for leftover in objects.glob("*.tmp"):
        if leftover.stat().st_mtime < hour_ago:
            leftover.unlink(missing_ok=True)
