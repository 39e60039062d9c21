"""Recorded plans kept on disk, so that a start does not record them again.

Recording a plan runs the model's whole step in Python against the recorder (every
binding validates its buffers, every op is split and appended): a noticeable part of
start-up, and of the first prompt of each length bucket. What it produces is two
arrays of op records, whose words are plain integers, kernel addresses and addresses
of the model's buffers. Those addresses differ between processes, so a plan is kept
with its addresses *relative*:

* a kernel address as its op's library symbol (looked up again on load, its arity
  compared);
* a buffer address as (region, offset): a region is one of the buffers the model
  names (``named``: activations, KV arenas, weight views of the mapping, ...), views
  that overlap merged into one and named after the first of them.

Which words are addresses comes from the kernels' signatures in the library's manifest
(an argument typed ``T*``). A plan with an address outside every region is not kept
(it is recorded each time, as before).

Nothing read back is trusted: the file carries the full key it was made for (code,
kernel library, CPU, model file, model shape, step shape, threads) and a CRC32 of all of
it, every region must exist with the same size and offset, every offset must lie within
its region, and the relocated words must be exactly the kernels' pointer arguments. A file that fails any of
these is removed and the plan recorded again. Files are written atomically
(runtime/atomic.py): a reader sees a whole file or none, and two processes storing the
same plan each write a whole file, the last one winning.
"""
import json
import mmap
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

from . import buffers, paths
from .plan import RECORD, Plan, _symbol_address

FORMAT_VERSION = 1
MAGIC = b"LLBPLAN\x01"
_HEAD = struct.Struct("<8sQI4x")       # magic, length of the JSON header, CRC32 of header + payload
CACHE_SUBDIR = "plans"
DIR_ENV = "LLAMBDA_PLAN_DIR"            # another directory for them
MAX_SCRATCH = 1 << 31                   # floats in one attention scratch at most (a forged size is refused)
MAX_BYTES = 256 << 20                   # the least recently used beyond this are removed when one is stored


class NotCacheable(ValueError):
    """A plan whose records hold something plan_cache cannot move to another process."""


# -- regions ---------------------------------------------------------------------------
class Regions:
    """The model's buffers as regions: ``named`` is ``(name, ndarray)`` in a fixed order.

    Overlapping arrays (views of one buffer) form one region, named after the first of
    them in that order, with its start's offset from that array."""

    def __init__(self, named):
        spans = []
        for order, (name, array) in enumerate(named):
            if array.nbytes:
                start = array.__array_interface__["data"][0]
                spans.append((start, start + array.nbytes, order, name))
        spans.sort()
        groups = []                     # [start, end, (order, name, its start)]
        for start, end, order, name in spans:
            if groups and start < groups[-1][1]:
                g = groups[-1]
                g[1] = max(g[1], end)
                g[2] = min(g[2], (order, name, start))
            else:
                groups.append([start, end, (order, name, start)])
        self.starts = np.array([g[0] for g in groups], dtype=np.uint64)
        self.ends = np.array([g[1] for g in groups], dtype=np.uint64)
        # per region: (name, start offset from that array, size)
        self.signature = [(g[2][1], g[2][2] - g[0], g[1] - g[0]) for g in groups]
        self.index = {sig[0]: i for i, sig in enumerate(self.signature)}
        if len(self.index) != len(groups):
            raise NotCacheable("two regions have the same name")


def _pointer_words(records, chunks, first_chunk, symbols, chunk_op):
    """Flat positions (records' int_args, then the chunks') of the words that are pointer
    arguments, from the kernels' signatures in the library manifest: an argument typed
    ``... *`` is an address, any other an integer."""
    n_words = records["int_args"].shape[-1]
    masks = np.array([_pointer_mask(symbol, n_words) for symbol in symbols], bool).reshape(len(symbols), n_words)
    static = np.array([f is None for f in first_chunk], bool)
    rec_mask = masks[:, None, :] & static[:, None, None] & (records["fn"] != 0)[:, :, None]
    chunk_mask = masks[chunk_op] if len(chunk_op) else np.zeros((0, n_words), bool)
    return np.flatnonzero(np.concatenate([rec_mask.reshape(-1), chunk_mask.reshape(-1)]))


_MASKS = {}


def _pointer_mask(symbol, n_words):
    """Per integer argument of ``symbol``: is it an address?"""
    mask = _MASKS.get((symbol, n_words))
    if mask is None:
        from . import library
        entry = library.load().manifest.get(symbol)
        if entry is None:
            raise ValueError(f"{symbol} is not in the kernel library")
        kinds = [ctype for _, ctype in entry["args"] if ctype != "float"]
        if len(kinds) > n_words:
            raise ValueError(f"{symbol} takes more integer arguments than a record holds")
        mask = _MASKS[(symbol, n_words)] = [ctype.endswith("*") for ctype in kinds] + [False] * (n_words - len(kinds))
    return mask


# -- freezing and thawing -----------------------------------------------------------------
def freeze(plan, ops, named, scratch):
    """``(header dict, payload bytes)`` of ``plan`` with its addresses relative to the
    regions of ``named`` and ``scratch`` (arrays the plan owns, allocated again on load).
    Raises NotCacheable."""
    if not all(a.dtype == np.float32 and a.ndim == 1 and 0 < a.size <= MAX_SCRATCH for a in scratch):
        raise NotCacheable("a scratch buffer that is not a flat float32 array")
    regions = Regions(list(named) + [(f"scratch[{i}]", a) for i, a in enumerate(scratch)])
    records, chunks, arity, first_chunk, symbols = plan.parts()
    if any(s is None for s in symbols):
        raise NotCacheable("an op calls a ctypes function, not a library symbol")
    addresses = [_symbol_address(s)[0] for s in symbols]
    rec_fn = records["fn"]
    for op, address in enumerate(addresses):
        row = rec_fn[op]
        if first_chunk[op] is None:
            if np.any((row != 0) & (row != address)):
                raise NotCacheable(f"op {op}: a record calls another kernel than its symbol")
        elif np.any(row != 0):
            raise NotCacheable(f"op {op}: a dynamic op's own records call a kernel")
    try:
        chunk_op = _chunk_ops(first_chunk, records, len(chunks))
    except ValueError as error:
        raise NotCacheable(str(error)) from None
    expected = np.array(addresses, dtype=np.uint64)[chunk_op] if len(chunks) else np.zeros(0, np.uint64)
    if np.any(chunks["fn"] != expected):
        raise NotCacheable("a chunk calls another kernel than its op's symbol")
    words = np.concatenate([records["int_args"].reshape(-1), chunks["int_args"].reshape(-1)])
    try:
        pointers = _pointer_words(records, chunks, first_chunk, symbols, chunk_op)
    except ValueError as error:
        raise NotCacheable(str(error)) from None
    if np.any(words[pointers] == 0):               # a stored offset 0 must mean a region's start
        raise NotCacheable("a pointer argument is NULL")
    pos = pointers
    if len(pos) and not len(regions.starts):
        raise NotCacheable("pointers, and no named buffer")
    found = words[pos]
    group = np.searchsorted(regions.starts, found, side="right").astype(np.int64) - 1
    inside = (group >= 0) & (found <= regions.ends[np.maximum(group, 0)])
    if not inside.all():
        raise NotCacheable(f"{int((~inside).sum())} address(es) lie in no named buffer")
    words = words.copy()
    words[pos] = found - regions.starts[group]
    rec_copy, chunk_copy = records.copy(), chunks.copy()
    rec_copy["fn"] = rec_fn != 0
    chunk_copy["fn"] = 1
    n_rec = records["int_args"].size
    rec_copy["int_args"] = words[:n_rec].reshape(records["int_args"].shape)
    chunk_copy["int_args"] = words[n_rec:].reshape(chunks["int_args"].shape)
    table = list(dict.fromkeys(symbols))
    sections = [rec_copy.tobytes(), chunk_copy.tobytes(), pos.astype(np.int64).tobytes(),
                group.astype(np.int32).tobytes(),
                np.array([table.index(s) for s in symbols], np.int32).tobytes(),
                np.array(arity, np.int32).reshape(-1, 2).tobytes(),
                np.array([-1 if f is None else f for f in first_chunk], np.int64).tobytes(),
                json.dumps([vars(info) for info in ops]).encode()]
    header = dict(n_threads=plan.n_threads, n_ops=len(records), n_chunks=len(chunks), n_reloc=int(len(pos)),
                  symbols=table, regions=[list(sig) for sig in regions.signature],
                  scratch=[[int(a.size), a.dtype.str] for a in scratch], sections=[len(b) for b in sections])
    return header, b"".join(sections)


class LazyOps:
    """The ops' OpInfo data of a kept plan, decoded when the profiler first asks."""

    def __init__(self, blob):
        self._blob, self._items = blob, None

    def items(self):
        if self._items is None:
            self._items = json.loads(bytes(self._blob))
            self._blob = None
        return self._items


def thaw(header, payload, named):
    """``(plan, LazyOps, scratch arrays)`` from ``freeze``'s output, its addresses
    moved to this process's buffers ``named``; ValueError when anything disagrees."""
    n_threads, n_ops, n_chunks, n_reloc = (int(header[k]) for k in ("n_threads", "n_ops", "n_chunks", "n_reloc"))
    sizes = [n_ops * n_threads * RECORD.itemsize, n_chunks * RECORD.itemsize, 8 * n_reloc, 4 * n_reloc,
             4 * n_ops, 8 * n_ops, 8 * n_ops]
    given = [int(n) for n in header["sections"]]
    if min(sizes) < 0 or given[:-1] != sizes or len(given) != len(sizes) + 1 or sum(given) != len(payload):
        raise ValueError("payload size")
    at = np.cumsum([0] + given)
    table = header["symbols"]
    index = np.frombuffer(payload, np.int32, n_ops, at[4])
    if n_ops and (index.min() < 0 or index.max() >= len(table)):
        raise ValueError("symbol index")
    symbols = [table[i] for i in index.tolist()]
    arity = [tuple(a) for a in np.frombuffer(payload, np.int32, 2 * n_ops, at[5]).reshape(n_ops, 2).tolist()]
    first_chunk = [None if f == -1 else f for f in np.frombuffer(payload, np.int64, n_ops, at[6]).tolist()]
    ops = LazyOps(bytes(payload[at[7]:at[8]]))           # a copy: the file's bytes are not kept
    if not all(dtype == "<f4" and 0 < int(size) <= MAX_SCRATCH for size, dtype in header["scratch"]):
        raise ValueError("scratch")
    scratch = [buffers.zeros(int(size), np.float32) for size, _ in header["scratch"]]
    regions = Regions(list(named) + [(f"scratch[{i}]", a) for i, a in enumerate(scratch)])
    # the records go straight into the plan's own buffers, and are moved there in place
    plan = Plan.from_parts(n_threads, np.frombuffer(payload, RECORD, n_ops * n_threads, at[0]).reshape(n_ops, n_threads),
                           np.frombuffer(payload, RECORD, n_chunks, at[1]), arity, first_chunk, symbols)
    records, chunks = plan.parts()[:2]
    pos = np.frombuffer(payload, np.int64, n_reloc, at[2])
    group = np.frombuffer(payload, np.int32, n_reloc, at[3])
    # the stored regions, as this process has them
    stored = header["regions"]
    new_start = np.zeros(len(stored), np.uint64)
    size = np.zeros(len(stored), np.uint64)
    for g, (name, offset, length) in enumerate(stored):
        i = regions.index.get(name)
        if i is None or list(regions.signature[i]) != [name, offset, length]:
            raise ValueError(f"region {name} differs")
        new_start[g], size[g] = regions.starts[i], length
    if np.any((records["fn"] != 0) & (records["fn"] != 1)) or np.any(chunks["fn"] != 1):
        raise ValueError("kernel flags")
    chunk_op = _chunk_ops(first_chunk, records, n_chunks)
    pointers = _pointer_words(records, chunks, first_chunk, symbols, chunk_op)
    if not np.array_equal(pointers, pos):
        raise ValueError("relocations are not the pointer arguments")
    if n_reloc and (group.min() < 0 or group.max() >= len(stored)):
        raise ValueError("relocations name no region")
    n_rec = records["int_args"].size
    for args, sel, shift in ((records["int_args"], pos < n_rec, 0), (chunks["int_args"], pos >= n_rec, n_rec)):
        where = np.unravel_index(pos[sel] - shift, args.shape)
        g = group[sel]
        if np.any(args[where] > size[g]):
            raise ValueError("an offset lies outside its region")
        args[where] += new_start[g]
    addresses = []
    for symbol, (n_int, n_float) in zip(symbols, arity):
        address, want_int, want_float = _symbol_address(symbol)
        if (n_int, n_float) != (want_int, want_float):
            raise ValueError(f"{symbol} takes other arguments now")
        addresses.append(address)
    addresses = np.array(addresses, dtype=np.uint64)
    records["fn"] = np.where(records["fn"] != 0, addresses[:, None], 0)
    if n_chunks:
        chunks["fn"] = addresses[chunk_op]
    return plan, ops, scratch


def _chunk_ops(first_chunk, records, n_chunks):
    """The op of each chunk record; ValueError unless the dynamic ops' chunks tile the
    chunk records in op order, as Plan.add appends them."""
    ops = np.array([op for op, first in enumerate(first_chunk) if first is not None], dtype=np.int64)
    if not len(ops):
        if n_chunks:
            raise ValueError("chunk records but no dynamic op")
        return np.zeros(0, np.int64)
    firsts = np.array([first_chunk[op] for op in ops], dtype=np.int64)
    counts = records["chunks"][ops, 0].astype(np.int64)
    ends = firsts + counts
    if (firsts[0] != 0 or ends[-1] != n_chunks or np.any(firsts[1:] != ends[:-1]) or np.any(counts < 1)
            or np.any(records["int_args"][ops, :, 0] != firsts[:, None].astype(np.uint64))):
        raise ValueError("the dynamic ops' chunks do not tile the chunk records")
    return np.repeat(ops, counts)


# -- the key and the files -------------------------------------------------------------------
def code_stamp():
    """The stamps (name, size, mtime) of llambda's own Python files: a changed recorder,
    binding or model changes every key."""
    import llambda
    from llambda import codegen          # its __init__ only: the contract module lives there
    here = Path(__file__).resolve().parent
    lines = [sys.version, str(FORMAT_VERSION)]
    for directory in (Path(llambda.__file__).resolve().parent, here, Path(codegen.__file__).resolve().parent):
        _stamp_package(directory, lines)
    return "\n".join(lines)


def _stamp_package(directory, lines):
    """Append the stamps of the .py files of ``directory`` and of its subpackages (llambda/model/,
    runtime/native/, codegen/paged/, ...), in name order."""
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name.endswith(".py") and entry.is_file():
                st = entry.stat()
                lines.append(f"{entry.path} {st.st_size} {st.st_mtime_ns} {st.st_ino}")
            elif entry.is_dir() and os.path.exists(os.path.join(entry.path, "__init__.py")):
                _stamp_package(entry.path, lines)


def environment_stamp():
    """What else decides which kernels a recording picks: the kernel library, the CPU's
    flags, and llambda's environment variables (LLAMBDA_ISA, ...)."""
    from . import cpu, library
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("LLAMBDA_"))
    return json.dumps([str(library.load().path), sorted(cpu.cpu_flags()), env])


def key_text(parts):
    """The whole key of a plan: ``parts`` (the model's file, config and shapes) and the stamps."""
    return json.dumps([parts, code_stamp(), environment_stamp()], default=str)


def path_for(key):
    import hashlib
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return plan_dir() / f"{digest}.plan"


def plan_dir():
    """``$LLAMBDA_PLAN_DIR``, else ``<cache>/plans``."""
    explicit = os.environ.get(DIR_ENV)
    return Path(explicit) if explicit else paths.cache_dir() / CACHE_SUBDIR


def encode(key, header, payload):
    text = json.dumps(dict(header, key=key, version=FORMAT_VERSION)).encode()
    crc = zlib.crc32(payload, zlib.crc32(text))
    return _HEAD.pack(MAGIC, len(text), crc) + text + payload


def decode(data, key):
    """``(header, payload)`` of a file's bytes made for ``key``; ValueError otherwise."""
    if len(data) < _HEAD.size:
        raise ValueError("short file")
    magic, n_text, crc = _HEAD.unpack_from(data)
    if magic != MAGIC or _HEAD.size + n_text > len(data):
        raise ValueError("not a plan file")
    view = memoryview(data)
    text, payload = view[_HEAD.size:_HEAD.size + n_text], view[_HEAD.size + n_text:]
    if zlib.crc32(payload, zlib.crc32(text)) != crc:
        raise ValueError("checksum")
    header = json.loads(bytes(text))
    if header.get("version") != FORMAT_VERSION or header.get("key") != key:
        raise ValueError("made for another key")
    return header, payload


def load(key, named):
    """``(plan, ops, scratch)`` kept for ``key``, or None (never kept; a damaged or stale
    file is removed)."""
    path = path_for(key)
    try:
        f = open(path, "rb")
    except OSError:
        return None
    try:
        with f:
            # mapped, not read: no big heap buffer that the allocator would keep resident
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        header, payload = decode(data, key)
        kept = thaw(header, payload, named)
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, struct.error, OSError, MemoryError):
        _remove(path)
        return None
    finally:
        data = payload = None           # the mapping goes with its last view
    try:
        os.utime(path)                  # recently used: pruned last
    except OSError:
        pass
    return kept


def store(key, plan, ops, named, scratch):
    """Keep ``plan`` for ``key`` (best effort: an unwritable cache or a plan that cannot
    be moved only means recording it next time). True if it was written."""
    try:
        header, payload = freeze(plan, ops, named, scratch)
    except (NotCacheable, ValueError):
        return False
    from . import atomic
    path = path_for(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic.create(path) as f:
            f.write(encode(key, header, payload))
    except OSError as e:
        report_unwritable(path.parent, e)
        return False
    _prune(path.parent)
    return True


_reported = set()


def report_unwritable(directory, error):
    """Say once per directory that plans cannot be kept there, and how to choose another:
    nothing fails, but every load then records its plans again."""
    if str(directory) in _reported:
        return
    _reported.add(str(directory))
    import warnings
    warnings.warn(f"llambda: cannot keep recorded plans in {directory} ({error.strerror or error}); every "
                  f"load records them again. Set ${DIR_ENV} to a writable directory.", RuntimeWarning, stacklevel=3)


def store_async(key, plan, ops, named, scratch):
    """``store`` on a thread of its own (returned, started): the plan must not change meanwhile."""
    import threading

    def run():
        try:
            store(key, plan, ops, named, scratch)
        except Exception:          # a cache that cannot be written only means recording again
            pass
    thread = threading.Thread(target=run, name="llambda-plan-store", daemon=True)
    thread.start()
    return thread


def _remove(path):
    try:
        path.unlink()
    except OSError:
        pass


def _prune(directory, budget=MAX_BYTES):
    """Remove the least recently used plan files beyond ``budget`` bytes in all (keys of
    code since edited, and of models no longer loaded, pile up otherwise)."""
    try:
        entries = []
        for e in os.scandir(directory):
            if e.name.endswith(".plan"):
                st = e.stat()
                entries.append((st.st_mtime_ns, st.st_size, e.path))
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= budget:
            break
        _remove(Path(path))
        total -= size
