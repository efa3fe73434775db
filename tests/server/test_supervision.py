"""Supervision, tried as an unlucky or hostile operator would: the API key is on no
command line, during start-up included."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, alive, children, dead_pid, free_port, wait_until


def cmdlines() -> dict[int, bytes]:
    """Every process's command line, as any local user can read it."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def showing(key: str) -> dict[int, str]:
    return {
        pid: line.replace(b"\0", b" ").decode(errors="replace")
        for pid, line in cmdlines().items()
        if key.encode() in line and pid != os.getpid()
    }


def watch_start(server: Server, key: str, grace_s: float = 0.0, timeout: float = 300.0) -> dict[int, str]:
    """Polls every command line from the moment `server` was started until it is healthy:
    the processes that showed `key`, `grace_s` after the start onwards."""
    t0 = time.monotonic()
    seen: dict[int, str] = {}
    while time.monotonic() - t0 < timeout:
        if time.monotonic() - t0 >= grace_s:
            seen.update(showing(key))
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.proc.returncode}")
        try:
            if httpx.get(server.url("/health"), timeout=0.5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
    else:
        raise TimeoutError("the server did not start")
    server.refresh()
    seen.update(showing(key))
    return seen


def check_key_works(server: Server, key: str) -> None:
    assert httpx.get(server.url("/v1/models"), timeout=10).status_code == 401
    ok = httpx.get(server.url("/v1/models"), headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert ok.status_code == 200


# ---------------------------------------------------------------- secrets (item 4)


def test_api_key_on_no_command_line_granian():
    key = "k-" + secrets.token_hex(16)
    server = Server.granian(workers=2, null_model=1, api_key=key, log_level="warning")
    try:
        seen = watch_start(server, key)
        assert seen == {}, seen
        assert len(server.engine) == 2 and all(alive(p) for p in server.engine.values())
        check_key_works(server, key)
        server.stop()
    finally:
        if server.proc.poll() is None:
            server.kill()


def test_api_key_on_no_command_line_serve():
    """`serve --api-key K`: the key is gone from serve's own command line at once (it is what
    the user typed: only the interpreter's start shows it), and never reaches granian's or the
    engine's; given as RINGSERVE_API_KEY it is on no command line at all."""
    key = "k-" + secrets.token_hex(16)
    server = Server.serve("--null-model", "--log-level", "warning", "--api-key", key)
    try:
        seen = watch_start(server, key, grace_s=1.0)
        assert seen == {}, seen
        check_key_works(server, key)
        server.stop()
    finally:
        if server.proc.poll() is None:
            server.kill()
    key = "k-" + secrets.token_hex(16)
    port = free_port()
    server = Server(
        [sys.executable, "-m", "runtime", "serve", "--port", str(port), "--null-model", "--log-level", "warning"],
        {"RINGSERVE_API_KEY": key},
        port,
    )
    try:
        seen = watch_start(server, key)
        assert seen == {}, seen
        check_key_works(server, key)
        server.stop(signal.SIGTERM)
    finally:
        if server.proc.poll() is None:
            server.kill()


# ---------------------------------------------------------------- other users' files (item 5)


def test_taken_runtime_dir_falls_back(tmp_path, monkeypatch):
    """/tmp/ringserve-<uid> made by another user first: this user's cache dir serves instead;
    with no usable directory at all, the error says what to do."""
    import tempfile

    from runtime.supervise.files import EngineStartError, runtime_dir

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    taken = tmp_path / "tmp" / f"ringserve-{os.getuid()}"
    taken.mkdir(parents=True, mode=0o700)
    if os.getuid() == 0:
        os.chown(taken, 65534, 65534)  # another user's
    else:
        taken.chmod(0o755)  # the same refusal: readable by others
    got = runtime_dir()
    assert got == tmp_path / "cache" / "ringserve" / "run"
    assert got.stat().st_mode & 0o777 == 0o700 and got.stat().st_uid == os.getuid()
    (tmp_path / "cache" / "ringserve" / "run").rmdir()
    (tmp_path / "cache" / "ringserve" / "run").write_text("not a directory")
    try:
        runtime_dir()
    except EngineStartError as e:
        assert f"Remove {taken}" in str(e) and "XDG_RUNTIME_DIR" in str(e), e
    else:
        raise AssertionError("no error without a usable directory")


@contextlib.contextmanager
def throwaway_user():
    """A throwaway user (root only), removed afterwards with whatever it left in /tmp."""
    if os.getuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, useradd and setpriv to run a server as another user")
    name = "rsv" + secrets.token_hex(4)
    made = subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    try:
        pw = pwd.getpwnam(name)
        yield pw
    finally:
        for pid in processes_of(pw.pw_uid):  # what the test started as this user: nothing else runs as it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not processes_of(pw.pw_uid), 10)
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / f"ringserve-{pw.pw_uid}", ignore_errors=True)


def other_users_python(env: dict[str, str]) -> str:
    """An interpreter another user may run: ours may live in root's home (pyenv); then the
    system's of the same version, with our virtual environment's packages on its path."""
    real = Path(os.path.realpath(sys.executable))
    if all(os.stat(p).st_mode & 0o001 for p in [real, *real.parents]):
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/local/bin:/usr/bin")
    if system is None:
        pytest.skip(f"our interpreter {real} is root's alone and there is no system {version}")
    site = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)]
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *site])
    return system


def processes_of(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                if entry.stat().st_uid == uid and alive(int(entry.name)):
                    pids.append(int(entry.name))
    return pids


def test_foreign_file_in_dev_shm_does_not_block_start():
    """A file named like a dead server's segment that this user may not remove (root's, in the
    sticky /dev/shm) does not stop a server of another user from starting and serving."""
    with throwaway_user() as pw:
        foreign = Path("/dev/shm") / f"ringserve.{dead_pid()}.{secrets.token_hex(8)}"
        foreign.write_bytes(b"not yours")
        top = Path(tempfile.mkdtemp(prefix="ringserve-test-"))  # pytest's tmp_path is root's alone
        home, cache = top / "home", top / "cache"
        home.mkdir()
        cache.mkdir()
        # the C builds and the converted model: this user's cache, hard links to ours
        ours = Path(os.environ.get("RINGSERVE_CACHE_DIR") or Path.home() / ".cache") / "ringserve"
        if ours.is_dir():
            subprocess.run(["cp", "-al", str(ours), str(cache / "ringserve")], check=True)
        for d in [top, home, cache, *[p for p in cache.rglob("*") if p.is_dir()]]:
            os.chown(d, pw.pw_uid, pw.pw_gid)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGSERVE_", "XDG_"))}
        env.update(HOME=str(home), RINGSERVE_CACHE_DIR=str(cache), RINGSERVE_NULL_MODEL="1")
        env.update(RINGSERVE_LOG_LEVEL="warning", RINGSERVE_IPC_NATIVE="0")
        python = other_users_python(env)
        argv = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", python]
        argv += ["-m", "granian", "--interface", "asgi", "--port", str(port), "--log-level", "warning"]
        proc = subprocess.Popen([*argv, "runtime.app:app"], env=env, cwd=os.getcwd(), start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            assert proc.poll() is None, "the server exited during start-up"
            body = {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
            resp = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
            # (other root processes' sweeps may remove it meanwhile: theirs may)
        finally:
            foreign.unlink(missing_ok=True)
            shutil.rmtree(top, ignore_errors=True)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            assert wait_until(lambda: not processes_of(pw.pw_uid), 15)  # the engine stops with granian


# ---------------------------------------------------------------- /dev/shm too small (item 8)


def test_full_dev_shm_is_an_error_at_creation(monkeypatch):
    from ipc import shm

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(shm.our_segments())
    with pytest.raises(shm.SharedMemoryFull) as caught:
        shm.create_segment(9 << 20)
    message = str(caught.value)
    assert "needs 9.0 MiB" in message and "/dev/shm has" in message and "free of" in message, message
    assert set(shm.our_segments()) <= before


def test_small_dev_shm_fails_start_up_with_the_message(tmp_path):
    """A 1 MiB /dev/shm (a private mount namespace): start-up fails and says why, no SIGBUS."""
    if os.getuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /dev/shm")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.strip()}")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    env.update(RINGSERVE_NULL_MODEL="1", RINGSERVE_LOG_LEVEL="warning")
    script = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"'
    argv = ["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "-m", "granian", "--interface", "asgi"]
    argv += ["--port", str(port), "--log-level", "warning", "runtime.app:app"]
    log = tmp_path / "stderr"
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, env=env, stderr=err, start_new_session=True)
    try:
        said = wait_until(lambda: b"shared memory is full" in log.read_bytes() or proc.poll() is not None, 120)
        assert said and wait_until(lambda: b"shared memory is full" in log.read_bytes(), 5), log.read_text()
        text = log.read_text()
        assert "/dev/shm has" in text and "free of 1.0 MiB" in text, text
        assert "SIGBUS" not in text and "Bus error" not in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# ---------------------------------------------------------------- the engine hangs, dies, heals (items 7, 9)


def engine_processes(server_pid: int) -> dict[str, list[int]]:
    """{role: pids} of the running engine processes of the server `server_pid`, found as the
    processes titled ringserve::<role> that watch that pid (a pidfd of it)."""
    found: dict[str, list[int]] = {"scheduler": [], "detokenizer": []}
    for pid, line in cmdlines().items():
        role = line.split(b"\0")[0].decode(errors="replace").removeprefix("ringserve::")
        if role not in found or not alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                if os.readlink(fd) == "anon_inode:[pidfd]":
                    info = (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text()
                    if f"Pid:\t{server_pid}\n" in info:
                        found[role].append(pid)
                        break
    return found


def one_engine(server: Server) -> dict[str, int]:
    """The server's engine, checked to be exactly one scheduler and one detokenizer."""
    procs = engine_processes(server.pid)
    assert len(procs["scheduler"]) == 1 and len(procs["detokenizer"]) == 1, procs
    return {role: pids[0] for role, pids in procs.items()}


def complete(server: Server, max_tokens: int = 4, timeout: float = 30) -> httpx.Response:
    body = {"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=timeout)


def healthy_again(server: Server, timeout: float = 120) -> float:
    """Seconds until /health answers 200 (on every worker that answers meanwhile)."""
    t0 = time.monotonic()

    def ok() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return all(httpx.get(server.url("/health"), timeout=2).status_code == 200 for _ in range(4))
        return False

    assert wait_until(ok, timeout, 0.2), httpx.get(server.url("/health"), timeout=5).text
    return time.monotonic() - t0


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_stopped_engine_process_is_caught_by_the_watchdog(victim):
    """SIGSTOP of the scheduler (or the detokenizer): a request waiting on it fails within
    --watchdog-timeout (plus the check's second), /health is 503, the hung process is killed,
    a new engine serves."""
    server = Server.granian(null_model=1, log_level="info", watchdog_timeout=3)
    try:
        server.wait_ready()
        assert complete(server).status_code == 200
        old = one_engine(server)
        os.kill(old[victim], signal.SIGSTOP)
        stopped = time.monotonic()
        resp = complete(server, timeout=60)
        waited = time.monotonic() - stopped
        assert resp.status_code == 503 and f"{victim} stopped responding" in resp.text, resp.text
        assert 3 <= waited < 3 + 2.5, waited
        health = httpx.get(server.url("/health"), timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        assert wait_until(lambda: not alive(old[victim]), 10)  # killed, not left stopped
        healthy_again(server)
        assert complete(server).status_code == 200
        new = one_engine(server)
        assert new["scheduler"] != old["scheduler"] and new["detokenizer"] != old["detokenizer"]
        server.stop()
        assert server.proc.returncode == 0
    finally:
        if server.proc.poll() is None:
            server.kill()


@pytest.mark.parametrize("workers", [1, 2])
def test_engine_heals_after_kill9(workers):
    """kill -9 of the scheduler, then of the detokenizer: each time a stream in flight fails at
    once, /health is 503 while a new engine starts, then every worker serves again, granian
    never restarted, and exactly one engine runs."""
    server = Server.granian(workers=workers, null_model=1, log_level="info")
    try:
        server.wait_ready()
        granian_workers = sorted(server.workers)
        for victim in ("scheduler", "detokenizer"):
            engine = one_engine(server)
            # a request in flight when it dies: the victim stopped first (the null model's
            # tokens would finish any stream before the kill), far from the watchdog's limit
            os.kill(engine[victim], signal.SIGSTOP)
            ended: list[tuple[float, int, str]] = []

            def stream() -> None:
                body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=30) as resp:
                    text = "".join(resp.iter_lines())
                ended.append((time.monotonic(), resp.status_code, text))

            thread = threading.Thread(target=stream)
            thread.start()
            time.sleep(1.0)
            assert not ended
            os.kill(engine[victim], signal.SIGKILL)
            killed = time.monotonic()
            thread.join(10)
            (at, status, text) = ended[0]
            assert at - killed < 2.0
            assert "engine" in text and (status == 503 or '"error"' in text), (status, text)
            assert httpx.get(server.url("/health"), timeout=5).status_code == 503
            print(f"{victim} killed: healthy again after {healthy_again(server):.1f} s")
            seen = set()
            for _ in range(8 * workers):
                resp = complete(server)
                assert resp.status_code == 200, resp.text
                seen.add(resp.headers["x-ringserve-worker"])
            assert len(seen) == workers
            new = one_engine(server)
            assert not set(new.values()) & set(engine.values())
        assert sorted(children(server.pid)) == granian_workers  # granian's workers: never restarted
        server.stop()
        assert server.proc.returncode == 0
        assert wait_until(lambda: engine_processes(server.pid) == {"scheduler": [], "detokenizer": []}, 15)
    finally:
        if server.proc.poll() is None:
            server.kill()


def test_crash_loop_gives_up_with_the_reason():
    """Past --engine-max-restarts replacements, the engine is left dead: 503 with the reason."""
    server = Server.granian(null_model=1, log_level="info", engine_max_restarts=1)
    try:
        server.wait_ready()
        os.kill(one_engine(server)["scheduler"], signal.SIGKILL)
        healthy_again(server)
        assert complete(server).status_code == 200
        os.kill(one_engine(server)["scheduler"], signal.SIGKILL)
        assert wait_until(lambda: engine_processes(server.pid) == {"scheduler": [], "detokenizer": []}, 15)
        time.sleep(3)  # nothing starts another
        assert engine_processes(server.pid) == {"scheduler": [], "detokenizer": []}
        health = httpx.get(server.url("/health"), timeout=5)
        assert health.status_code == 503 and "--engine-max-restarts 1" in health.text, health.text
        resp = complete(server)
        assert resp.status_code == 503 and "Restart the server" in resp.text, resp.text
        server.stop()
    finally:
        if server.proc.poll() is None:
            server.kill()


def test_sighup_reload_with_two_workers_keeps_one_engine():
    """granian's reload (SIGHUP) with 2 workers after the engine died and was not replaced
    (--engine-max-restarts 0): the new workers start exactly one engine, and the stopping old
    workers' clean-up leaves its files alone (it used to delete them, so the second new worker
    started a second engine). Then kill -9: the new workers heal it as one engine."""
    server = Server.granian(workers=2, null_model=1, log_level="info", engine_max_restarts=0)
    try:
        server.wait_ready()
        old_workers = set(server.workers)
        engine = one_engine(server)
        os.kill(engine["scheduler"], signal.SIGKILL)
        assert wait_until(lambda: engine_processes(server.pid) == {"scheduler": [], "detokenizer": []}, 15)
        assert wait_until(lambda: "engine-max-restarts" in httpx.get(server.url("/health"), timeout=5).text, 10)
        os.kill(server.pid, signal.SIGHUP)
        assert wait_until(lambda: not old_workers & set(children(server.pid)), 120)  # all replaced
        healthy_again(server)
        time.sleep(3)  # a second engine would be starting by now
        new = one_engine(server)
        assert not set(new.values()) & set(engine.values())
        seen = set()
        for _ in range(16):
            resp = complete(server)
            assert resp.status_code == 200, resp.text
            seen.add(resp.headers["x-ringserve-worker"])
        assert len(seen) == 2
        assert one_engine(server) == new
        server.stop()
        assert wait_until(lambda: engine_processes(server.pid) == {"scheduler": [], "detokenizer": []}, 15)
    finally:
        if server.proc.poll() is None:
            server.kill()


def test_supervision_flags():
    from runtime.config import ServerArgs

    args = ServerArgs.from_cli(["--watchdog-timeout", "2.5", "--engine-max-restarts", "0"])
    assert (args.watchdog_timeout, args.engine_max_restarts) == (2.5, 0)
    assert ServerArgs.from_env({"RINGSERVE_WATCHDOG_TIMEOUT": "7"}).watchdog_timeout == 7.0
    assert ServerArgs().watchdog_timeout == 300.0 and ServerArgs().engine_max_restarts == 5
    for bad in ({"watchdog_timeout": 0}, {"engine_max_restarts": -1}):
        with pytest.raises(ValueError, match=next(iter(bad)).replace("_", "-")):
            ServerArgs(**bad)
