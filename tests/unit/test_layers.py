"""The import graph of ringserve's own packages: layers that only point down, and no cycle.

Every `import` and `from ... import` of our modules is read from the source (those inside
functions too), so a lazy import cannot hide an upward edge. A module's layer is that of the
longest prefix of its name in LAYERS; it may import its own layer and those below it, never
one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "ipc", "gpu", "structured", "httpapi", "runtime")
# lowest first: each imports only from its own layer and those before it
LAYERS = [
    ("cbuild", "protocol"),
    ("ipc", "gpu"),
    ("structured",),
    ("httpapi",),
    (
        "runtime.settings",
        "runtime.config",
        "runtime.heap_trim",
        "runtime.gc_tuning",
        "runtime.engine_stats",
        "runtime.lora_registry",
        "runtime.ttft_trace",
        "runtime.tokenizer_load",
    ),
    ("runtime.detokenizer",),
    ("runtime.scheduler",),
    ("runtime.supervise",),
    ("runtime.http_worker", "runtime.offline"),
    ("runtime.app", "runtime.__main__", "runtime"),
]
# One process's folder does not import another's (supervise/ starts them, so it may), but for
# the calls named here
SIBLING_CALLS = {("runtime.scheduler.process", "runtime.detokenizer.process")}  # connect_detokenizer


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    found = {"cbuild": ROOT / "cbuild.py"}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports (a `from pkg import mod` names pkg.mod)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def layer_of(name: str) -> int:
    best, rank = "", None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS"
    return rank


def process_folder(name: str) -> str | None:
    parts = name.split(".")
    folders = ("detokenizer", "scheduler", "http_worker")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[0] == "runtime" and parts[1] in folders else None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = our_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_import_points_down(graph):
    upward = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) > layer_of(a)
    ]
    assert not upward, "\n".join(upward)


def test_process_folders_do_not_import_each_other(graph):
    crossing = [
        f"{a} imports {b}"
        for a, targets in graph.items()
        for b in targets
        if process_folder(a)
        and process_folder(b)
        and process_folder(a) != process_folder(b)
        and (a, b) not in SIBLING_CALLS
    ]
    assert not crossing, "\n".join(crossing)


def test_no_import_cycle(graph):
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The graph reader on made-up modules: a lazy upward import and a cycle are both found."""
    modules = {"ipc.a": Path("a.py"), "ipc.b": Path("b.py"), "runtime.scheduler.core": Path("c.py")}
    tree_a = "def f():\n    from runtime.scheduler import core\n"
    tree_b = "import ipc.a\n"
    found = {}
    for name, src in (("ipc.a", tree_a), ("ipc.b", tree_b)):
        path = ROOT / "tests" / f"_layers_probe_{name.replace('.', '_')}.py"
        path.write_text(src)
        try:
            found[name] = imports_of(name, path, modules)
        finally:
            path.unlink()
    assert found == {"ipc.a": {"runtime.scheduler.core"}, "ipc.b": {"ipc.a"}}
    assert layer_of("runtime.scheduler.core") > layer_of("ipc.a")


def test_the_benchmarks_import_no_test_module():
    """perf/ measures the packages; what it needs of a reference (transformers' model of a
    file) lives in the packages, never in tests/, which sit above it."""
    offenders = []
    for path in sorted((ROOT / "perf").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("tests", "conftest")]
    assert not offenders, offenders
