"""POSIX shared-memory segments that never outlive their processes.

A segment is created 0600 under a unique name (`/ringserve.<pid>.<random>`),
mapped, and unlinked before `create_segment` returns: from then on it exists only
as an open fd and mappings, which the other side receives over a unix socket
(ipc/handoff.py, SCM_RIGHTS). The kernel frees it when the last fd and mapping
are gone, so a clean close and a kill -9 of either side leave nothing in /dev/shm.

The only window in which a name exists is between shm_open and shm_unlink inside
`create_segment` (two consecutive syscalls plus an mmap). A kill -9 exactly there
leaves one name behind; the pid in the name makes it attributable, and
`sweep_orphans()` (run before every create) unlinks names whose pid is dead, and skips
those it may not remove (another user's, in the sticky /dev/shm): the random part of every
name means no file another user prepares can collide with ours.

/dev/shm is world-writable: any local user may put anything there under a name that looks
like ours (a directory, a symlink, a fifo, a pid no process can have, a file of theirs). The
sweep and every listing here take only regular files of this user whose whole name parses
(lstat: never followed), skip everything else without raising, and remove only a name of
this user whose creator's pid is provably dead: what another user made there is never ours.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat

import posix_ipc

PREFIX = "ringserve."
_SHM_DIR = "/dev/shm"
PID_MAX_LIMIT = 4_194_304  # the kernel's ceiling for pid_max: no process has a larger pid
_NAME = re.compile(r"ringserve\.([1-9][0-9]{0,6})\.[0-9a-f]{16}", re.ASCII)  # PREFIX, pid, token_hex(8)


class SharedMemoryFull(OSError):
    """/dev/shm cannot hold a segment: the message says how much it needs and how much there is."""


def create_segment(size: int) -> tuple[int, mmap.mmap]:
    """A fresh zeroed shared segment of `size` bytes: (fd, mapping); its name is already gone.
    Its memory is reserved here (posix_fallocate): a /dev/shm too small fails now with
    SharedMemoryFull, never later with a SIGBUS at the first touch of a page it cannot back."""
    if size <= 0:
        raise ValueError(f"segment size must be positive, not {size}")
    sweep_orphans()
    name = f"/{PREFIX}{os.getpid()}.{secrets.token_hex(8)}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        fd = os.dup(shm.fd)
    finally:
        shm.close_fd()
        shm.unlink()
    try:
        _reserve(fd, size)
        return fd, map_segment(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise SharedMemoryFull(errno.ENOSPC, shm_full_message(size)) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot reserve: as before
            raise


def shm_full_message(size: int) -> str:
    try:
        st = os.statvfs(_SHM_DIR)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        there = f"{_SHM_DIR} has {_mib(free)} free of {_mib(total)}"
    except OSError:
        there = f"{_SHM_DIR} cannot be measured"
    return (
        f"shared memory is full: a ring needs {_mib(size)} and {there}; make {_SHM_DIR} larger "
        f"(a container: --shm-size; a server's rings take about 26 MiB for each HTTP worker and 9 MiB "
        f"for the engine) or stop what fills it"
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def map_segment(fd: int, size: int) -> mmap.mmap:
    """Maps a segment received as an fd; pages are faulted in now, not on the hot path."""
    actual = os.fstat(fd).st_size
    if actual < size:
        raise ValueError(f"shared segment is {actual} bytes, expected at least {size}")
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def segment_pid(name: str) -> int | None:
    """The creator's pid in a name create_segment gives (`ringserve.<pid>.<16 hex digits>`);
    None for any other name, a pid no process can have included."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    pid = int(match.group(1))
    return pid if pid <= PID_MAX_LIMIT else None


def our_segments() -> list[str]:
    """Names of ringserve segments currently in /dev/shm (normally none): regular files of
    this user whose names parse. Whatever else is there is not ours and is left out."""
    return sorted(name for name, _ in _our_segment_pids())


def _our_segment_pids() -> list[tuple[str, int]]:
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return []
    ours = []
    for name in names:
        pid = segment_pid(name)
        if pid is None:
            continue
        try:
            st = os.lstat(os.path.join(_SHM_DIR, name))
        except OSError:  # gone meanwhile
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            ours.append((name, pid))
    return ours


def sweep_orphans() -> list[str]:
    """Unlinks segments left by processes killed inside create_segment; returns their names.
    Never raises: a name it cannot remove stays (see the module docstring)."""
    swept = []
    for name, pid in _our_segment_pids():
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + name)
            swept.append(name)
        except posix_ipc.ExistentialError:
            pass  # another process swept it first
        except (posix_ipc.Error, OSError):
            pass  # not ours to remove after all (root's view of another user's, say): left alone
    return swept


def _alive(pid: int) -> bool:
    """False only when no process has `pid` (which segment_pid bounded)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's (EPERM), or it cannot be told: not provably dead
    return True
