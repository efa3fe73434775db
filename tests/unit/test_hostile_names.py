"""What any local user can put in /dev/shm (world-writable, sticky) under names shaped like
ours, and what a careless one can put in the runtime directory: the sweeps skip it, never
follow it, never raise on it, and remove only names of this user whose pid is dead."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ipc import shm
from runtime.supervise.files import ServerFiles, sweep_stale_servers
from tests.conftest import FOREIGN_UID, dead_pid, hostile_names, shapes_of

DEV_SHM = Path("/dev/shm")


@pytest.mark.parametrize(
    ("name", "pid"),
    [
        ("ringserve.1234.0123456789abcdef", 1234),
        ("ringserve.4194304.0123456789abcdef", 4_194_304),  # the kernel's limit
        ("ringserve.4194305.0123456789abcdef", None),  # beyond it
        ("ringserve.99999999999999999999.0123456789abcdef", None),
        ("ringserve.99999999999999999999.x", None),
        ("ringserve.999997.d", None),
        ("ringserve.0.0123456789abcdef", None),
        ("ringserve.-5.0123456789abcdef", None),
        ("ringserve.+5.0123456789abcdef", None),
        ("ringserve.0005.0123456789abcdef", None),
        ("ringserve.\u0663.0123456789abcdef", None),  # a digit to int(), not to us
        ("ringserve.12.0123456789ABCDEF", None),
        ("ringserve.12.0123456789abcdef\n", None),
        ("ringserve.12.0123456789abcdef.x", None),
        ("ringserve.12", None),
        ("sem.ringserve.12.0123456789abcdef", None),
    ],
)
def test_only_names_we_give_parse(name, pid):
    assert shm.segment_pid(name) == pid


def test_sweep_skips_every_hostile_shape():
    """Each shape survives the sweep untouched, is not listed as ours, and segments are
    still created past it."""
    with hostile_names(DEV_SHM, shm.PREFIX, dead_pid()) as made:
        before = shapes_of(made)
        assert None not in before.values()
        swept = shm.sweep_orphans()
        assert not set(swept) & {p.name for p in made.values()}
        assert not set(shm.our_segments()) & {p.name for p in made.values()}
        fd, mapping = shm.create_segment(4096)
        mapping.close()
        os.close(fd)
        assert shapes_of(made) == before
        assert Path(os.readlink(made["symlink"])).read_text() == "not to be touched"
    if os.geteuid() == 0:
        assert {"foreign owner", "unreadable"} <= set(made)


def test_sweep_removes_a_dead_pids_segment_of_ours_even_unreadable():
    """A name of ours (this user's regular file, the pid dead) is a leftover, whatever its
    mode: the sweep unlinks it without reading it."""
    path = DEV_SHM / f"{shm.PREFIX}{dead_pid()}.{os.urandom(8).hex()}"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o000))
    try:
        assert path.name in shm.our_segments()
        assert path.name in shm.sweep_orphans()
        assert not os.path.lexists(path)
    finally:
        path.unlink(missing_ok=True)


def test_stale_server_sweep_skips_hostile_shapes(tmp_path):
    """In the runtime directory: a lock that is a directory, a symlink, a fifo, another user's
    or has a pid no process can have leaves its server's files alone; a dead server's regular
    lock of this user still has them removed."""
    dead = [pid for pid in range(dead_pid(), dead_pid() - 50, -1) if not Path(f"/proc/{pid}").exists()][:6]
    target = tmp_path / "target"
    target.write_text("not to be touched")
    root = tmp_path / "run"
    root.mkdir()
    locks = {shape: root / f"engine-{pid}.lock" for shape, pid in zip(("directory", "symlink", "fifo"), dead)}
    locks["directory"].mkdir()
    locks["symlink"].symlink_to(target)
    os.mkfifo(locks["fifo"])
    locks["huge pid"] = root / f"engine-{'9' * 20}.lock"
    locks["huge pid"].write_text("")
    if os.geteuid() == 0:  # chown: root only
        locks["foreign owner"] = root / f"engine-{dead[3]}.lock"
        locks["foreign owner"].write_text("")
        os.chown(locks["foreign owner"], FOREIGN_UID, FOREIGN_UID)
    kept = [lock.with_suffix(".json") for lock in locks.values()]
    for path in kept:
        path.write_text("{}")
    before = shapes_of(locks)
    assert sweep_stale_servers(root) == []
    assert shapes_of(locks) == before
    assert all(path.exists() for path in kept)
    assert target.read_text() == "not to be touched"
    stale = root / f"engine-{dead[-1]}.lock"
    stale.write_text("")
    stale.with_suffix(".json").write_text("{}")
    assert sweep_stale_servers(root) == [dead[-1]]
    assert not stale.exists() and not stale.with_suffix(".json").exists()


def test_remove_never_follows_a_symlink(tmp_path):
    """A dead server's files: a symlink among them is removed itself, what it points at stays."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("keep")
    root = tmp_path / "run"
    root.mkdir()
    files = ServerFiles(dead_pid(), root)
    files.metrics_dir.symlink_to(elsewhere)
    files.stats.symlink_to(elsewhere / "keep")
    files.lock.write_text("")
    files.remove()
    assert list(root.iterdir()) == []
    assert (elsewhere / "keep").read_text() == "keep"
    assert stat.S_ISDIR(elsewhere.lstat().st_mode)
