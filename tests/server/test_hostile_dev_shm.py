"""A server among what any local user can put in /dev/shm under names shaped like ours (and
what a careless one can put in the runtime directory): it starts, heals a kill -9 of its
scheduler, and reloads (SIGHUP, 2 workers) with every shape present, and leaves each shape as
it was. Each of these used to fail: start-up on the sweep's IsADirectoryError or
OverflowError, healing and reload on the same errors in the new processes."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

from ipc.shm import PREFIX
from runtime.supervise.files import ServerFiles, runtime_dir
from tests.conftest import Server, children, dead_pid, hostile_names, shapes_of, wait_until
from tests.server.test_supervision import complete, engine_processes, healthy_again, one_engine

DEV_SHM = Path("/dev/shm")


def serves_on_every_worker(server: Server, workers: int, timeout: float = 120) -> None:
    """Every request succeeds, and each worker answers some (a reloaded one may still be starting)."""
    seen: set[str] = set()

    def every_worker_answered() -> bool:
        resp = complete(server)
        assert resp.status_code == 200, resp.text
        seen.add(resp.headers["x-ringserve-worker"])
        return len(seen) == workers

    assert wait_until(every_worker_answered, timeout, 0.1), seen


def test_start_heal_and_reload_among_hostile_names():
    with (
        hostile_names(DEV_SHM, PREFIX, dead_pid()) as at_start,
        hostile_names(runtime_dir(), "engine-", dead_pid()) as in_runtime_dir,
    ):
        before = shapes_of(at_start) | shapes_of(in_runtime_dir)
        server = Server.granian(workers=2, null_model=1, log_level="info")
        try:
            server.wait_ready()
            serves_on_every_worker(server, 2)
            with hostile_names(DEV_SHM, PREFIX, dead_pid()) as while_running, tempfile.TemporaryDirectory() as out:
                # worker indices no worker holds, in this server's own names
                own = ServerFiles.of(server.pid)
                (Path(out) / "target").write_text("not to be touched")
                own.worker_lock(7).mkdir()
                own.worker_lock(8).symlink_to(Path(out) / "target")
                os.mkfifo(own.worker_lock(9))
                running_before = shapes_of(while_running)

                engine = one_engine(server)
                os.kill(engine["scheduler"], signal.SIGKILL)
                print(f"scheduler killed: healthy again after {healthy_again(server):.1f} s")
                serves_on_every_worker(server, 2)
                healed = one_engine(server)
                assert not set(healed.values()) & set(engine.values())

                old_workers = set(children(server.pid))
                os.kill(server.pid, signal.SIGHUP)
                assert wait_until(lambda: not old_workers & set(children(server.pid)), 120)  # all replaced
                print(f"reloaded: healthy again after {healthy_again(server):.1f} s")
                serves_on_every_worker(server, 2)
                assert one_engine(server) == healed

                assert shapes_of(while_running) == running_before
                assert (Path(out) / "target").read_text() == "not to be touched"
                own.worker_lock(7).rmdir()
                own.worker_lock(8).unlink()
                own.worker_lock(9).unlink()
            assert shapes_of(at_start) | shapes_of(in_runtime_dir) == before
            server.stop()
            assert server.proc.returncode == 0
            assert wait_until(lambda: engine_processes(server.pid) == {"scheduler": [], "detokenizer": []}, 15)
            assert server.leftovers() == ([], [])
        finally:
            if server.proc.poll() is None:
                server.kill()
