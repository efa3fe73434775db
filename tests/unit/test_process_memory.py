"""process_resident_memory_bytes: the server's processes found from /proc (this test process
as the server, real children as its workers and engine), their RSS, and the exposition of a
worker whose prometheus_client is not in multiprocess mode, where the default process
collector's own unlabelled family would otherwise repeat the name."""

from __future__ import annotations

import os
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from runtime.http_worker.process_memory import resident_bytes, server_processes
from runtime.supervise.files import EngineProcess, process_start_time

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


def sleeper() -> subprocess.Popen:
    """A child running its own program: until it has exec'd, a forked child's RSS is this
    test process's (over 1 GiB late in the unit tier)."""
    child = subprocess.Popen(SLEEPER, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "up\n"
    return child


def test_roles_and_sizes_of_the_servers_processes():
    worker, engine = sleeper(), sleeper()
    try:
        scheduler = EngineProcess("scheduler", engine.pid, process_start_time(engine.pid) or -1)
        found = server_processes(os.getpid(), [scheduler])
        assert found[0] == ("server", os.getpid())
        assert ("http_worker", worker.pid) in found and found[-1] == ("scheduler", engine.pid)
        assert ("http_worker", engine.pid) not in found
        size = resident_bytes(worker.pid)
        assert size is not None and 1 << 20 < size < 1 << 30
    finally:
        for p in (worker, engine):
            p.kill()
            p.wait()
    assert resident_bytes(worker.pid) is None


def test_one_family_without_multiprocess_mode():
    code = """
import os
import prometheus_client  # imported first: no multiprocess mode
from runtime.http_worker.metrics import WorkerMetrics
m = WorkerMetrics("m")
body, _ = m.render(None, {"dead": False, "index": 0, "rings": {}, "processes": [("http_worker", os.getpid())]})
print(body.decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    families = [f for f in text_string_to_metric_families(out.stdout) if f.name == "process_resident_memory_bytes"]
    assert len(families) == 1
    [sample] = families[0].samples
    assert sample.labels["role"] == "http_worker" and sample.value > 1 << 20
