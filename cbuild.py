"""C sources built with the system compiler on first use, cached by content.

Shared by gpu.kernels (ctypes libraries), ipc, gpu.kvcache and runtime (CPython extensions): all call
`build`, which compiles once into the cache directory, keyed by the sources, the
headers they may include and the flags, so an edited source or another Python
rebuilds and an unchanged one is only loaded."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


class BuildError(RuntimeError):
    """A C source cannot be built here; the message is one line."""


def cache_root() -> Path:
    base = os.environ.get("RINGSERVE_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "ringserve" if base else Path.home() / ".cache" / "ringserve"


def build(
    name: str,
    sources: Sequence[Path],
    flags: Sequence[str],
    headers: Sequence[Path] = (),
    subdir: str = "kernels",
    suffix: str = ".so",
) -> Path:
    """The shared library `name` built from `sources` with `flags` (cached)."""
    content = b"".join(p.read_bytes() for p in [*sources, *headers])
    key = hashlib.sha256(content + " ".join(flags).encode()).hexdigest()[:16]
    path = cache_root() / subdir / f"{name}-{key}{suffix}"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # one compile of a key at a time, machine-wide: the engine's processes and the threads that
    # build ahead (gpu/model_runner.py) wait for the build under way instead of repeating it
    lock = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            _compile(sources, flags, path, suffix)
    finally:
        os.close(lock)
    return path


def _compile(sources: Sequence[Path], flags: Sequence[str], path: Path, suffix: str) -> None:
    """Compiles into a temporary file renamed to `path`: a reader never sees half a library."""
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=path.parent)
    os.close(fd)
    compiler = os.environ.get("CC", "cc")
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, *map(str, sources)], capture_output=True, text=True)
    except FileNotFoundError:
        os.unlink(tmp)
        raise BuildError(f"{sources[0].name} is built with a C compiler; {compiler} was not found (set CC)") from None
    if done.returncode != 0:
        os.unlink(tmp)
        first = (done.stderr.strip() or "?").splitlines()[0]
        raise BuildError(f"building {sources[0].name} failed: {first}")
    os.replace(tmp, path)


def build_extension(qualname: str, source: Path, subdir: str) -> ModuleType:
    """The CPython extension module `qualname` (its PyInit_ named after the last part) built
    from one C source (cached) and imported; raises BuildError, ImportError or OSError."""
    flags = ("-O2", "-shared", "-fPIC", "-fno-strict-aliasing", f"-I{sysconfig.get_paths()['include']}")
    name = qualname.rpartition(".")[2]
    path = build(name, [source], flags, subdir=subdir, suffix=sysconfig.get_config_var("EXT_SUFFIX"))
    spec = importlib.util.spec_from_file_location(qualname, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable extension module", name=qualname, path=str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
