"""Files that appear whole or not at all, and leave nothing behind when the writer is killed.

    with atomic.create(path) as f:        # f: a binary file object
        f.write(data)
    # here `path` holds exactly `data`; on any exception it is as it was before

The data goes to an unnamed file (``O_TMPFILE`` on the target's directory) that is given
its name only at the end (linked through ``/proc/self/fd``), so a process killed by
SIGKILL or SIGTERM halfway leaves no file at all: the kernel frees an unnamed file with
its last descriptor. Where the file system or kernel has no ``O_TMPFILE`` (or ``/proc``
is not mounted), a named temporary ``.<name>.<pid>.<random>.tmp`` is used instead, and
every ``create`` in a directory first removes the temporaries there whose process is
dead (``clean_stale``).

``readonly=True`` (the default) leaves the result mode 0444 (less the umask): llambda
never rewrites its files in place, and an in-place overwrite of a file that a running
llambda maps (``cp new.llb old.llb``) would change the mapped bytes under it. (Root
ignores the mode; the SIGBUS guard in runtime/faults.py covers that case.)
"""
import contextlib
import errno
import os
import re
import secrets
import shutil
from pathlib import Path

READONLY_MODE = 0o444
# ".<name>.<pid>[.<hex>].tmp" files, and catalog's ".download-<pid>-<random>" directories
_STALE_FILE = re.compile(r"^\..+\.(\d+)(\.[0-9a-f]+)?\.tmp$")
_STALE_DIR = re.compile(r"^\.download-(\d+)-.+$")


@contextlib.contextmanager
def create(path, readonly=True, check=None):
    """Write ``path`` atomically (see the module docstring).

    check: called with a path that opens the finished data before it gets its name
    (``/proc/self/fd/N`` or the temporary's); an exception from it leaves nothing."""
    path = Path(path)
    directory = path.parent
    clean_stale(directory)
    fd, tmp = _open_unnamed(directory)
    if fd is None:
        tmp = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            yield out
            out.flush()
            os.fsync(fd)
        if readonly:
            os.fchmod(fd, READONLY_MODE & ~_umask())
        if check is not None:
            check(tmp if tmp is not None else f"/proc/self/fd/{fd}")
        if tmp is None:
            _link_unnamed(fd, path)
        else:
            os.replace(tmp, path)
            tmp = None
    finally:
        os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    fsync_directory(directory)


def _open_unnamed(directory):
    """(fd, None) of an O_TMPFILE file in ``directory``, or (None, None) where unsupported."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None, None
    try:
        return os.open(directory, flag | os.O_WRONLY, 0o666), None
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None, None     # the file system (or an old kernel) has no unnamed files
        raise


def _link_unnamed(fd, path):
    """Give the unnamed file ``fd`` the name ``path``, replacing what is there atomically."""
    try:
        _linkat(fd, path)
        return
    except FileExistsError:
        pass
    # linkat cannot replace: link beside it under a temporary name, then rename over
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    _linkat(fd, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _linkat(fd, path):
    # linkat(/proc/self/fd, "N", path, AT_SYMLINK_FOLLOW). os.link calls plain link(),
    # which links the /proc symlink itself (EXDEV), unless given a directory fd.
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def clean_stale(directory):
    """Remove the temporaries in ``directory`` left by llambda processes that are dead:
    ``.<name>.<pid>[.<hex>].tmp`` files and ``.download-<pid>-*`` directories."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _STALE_FILE.match(name) or _STALE_DIR.match(name)
        if match is None or _alive(int(match[1])):
            continue
        target = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.unlink(target)


def _alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True      # someone else's process (or an odd number): leave it
    return True


def _umask():
    """The process umask, read without changing it (os.umask would, for a moment, for
    every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def fsync_directory(directory):
    # Makes the rename itself durable; some file systems refuse to open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
