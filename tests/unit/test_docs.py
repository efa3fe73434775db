"""The documentation points at things that exist: README.md, docs/*.md and perf/README.md.

- every relative Markdown link names an existing file or folder, and its #anchor a heading
  of the target;
- every path of ours written in backticks (inline or in a fenced block: `runtime/...`,
  `ipc/...`, `scripts/...`, ...) exists; `perf/results/` is left out (benchmark output,
  present only after a run);
- every dotted name of ours in backticks (`runtime.scheduler.core`, `runtime.app:app`,
  `protocol.record_bytes.take_records`) is a module importlib.util.find_spec finds (which imports
  only its parent packages), followed by names the module's source defines (read with ast,
  not imported);
- README.md is a manual, not a lab notebook: under 300 lines.

The checks are plain functions over a document's text, so the tests at the bottom can show
that each one fails on a broken document.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUR_DIRS = ("runtime", "ipc", "gpu", "structured", "httpapi", "protocol", "perf", "scripts", "tests", "docs")
OUR_PACKAGES = ("runtime", "ipc", "gpu", "structured", "httpapi", "protocol", "perf")
GENERATED = ("perf/results",)  # written by the benchmarks
README_MAX_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")
_PATH = re.compile(rf"^(?:\./)?((?:{'|'.join(OUR_DIRS)})/[\w./-]*)$")
_DOTTED = re.compile(rf"^((?:{'|'.join(OUR_PACKAGES)})(?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*))?$")
_IMPORT = re.compile(
    rf"^\s*(?:from\s+((?:{'|'.join(OUR_PACKAGES)})[\w.]*)\s+import\s+([\w, ()]+)"
    rf"|import\s+((?:{'|'.join(OUR_PACKAGES)})[\w.]*))"
)


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if (ROOT / "perf" / "README.md").exists():
        files.append(ROOT / "perf" / "README.md")
    return files


# ---------------------------------------------------------------- reading a document


class Doc:
    """A Markdown document split into what the checks read: prose (fenced blocks and code
    spans blanked out, offsets kept), inline code spans and fenced blocks, with line numbers."""

    def __init__(self, path: Path, text: str | None = None) -> None:
        self.path = path
        self.text = path.read_text() if text is None else text
        self.spans: list[tuple[int, str]] = []  # (line, content) of each inline code span
        self.blocks: list[tuple[int, str, list[str]]] = []  # (first line, info string, lines)
        prose = []
        fence: str | None = None
        for number, line in enumerate(self.text.split("\n"), 1):
            opener = _FENCE.match(line)
            if fence is None and opener:
                fence = opener.group(1)
                self.blocks.append((number + 1, line.strip()[3:].strip(), []))
                prose.append(" " * len(line))
            elif fence is not None:
                if line.strip().startswith(fence) and not line.strip()[len(fence) :].strip():
                    fence = None
                else:
                    self.blocks[-1][2].append(line)
                prose.append(" " * len(line))
            else:
                for m in _CODE_SPAN.finditer(line):
                    self.spans.append((number, m.group(2).strip()))
                prose.append(_CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line))
        self.prose = "\n".join(prose)

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1

    def links(self) -> list[tuple[int, str]]:
        found = [(self.line_of(m.start()), m.group(1)) for m in _LINK.finditer(self.prose)]
        found += [(self.line_of(m.start()), m.group(1)) for m in _REF_DEF.finditer(self.prose)]
        return found

    def code_tokens(self) -> list[tuple[int, str]]:
        """Every whitespace-separated word of the code spans and fenced blocks."""
        tokens = [(line, word) for line, span in self.spans for word in span.split()]
        for first, _, lines in self.blocks:
            tokens += [(first + i, word) for i, line in enumerate(lines) for word in line.split()]
        return tokens

    def python_imports(self) -> list[tuple[int, str]]:
        """Dotted names of ours imported in the fenced Python blocks (`from m import a, b`: m.a, m.b)."""
        names = []
        for first, info, lines in self.blocks:
            if info.split()[:1] not in (["python"], ["py"]):
                continue
            for i, line in enumerate(lines):
                m = _IMPORT.match(line)
                if m is None:
                    continue
                if m.group(3):
                    names.append((first + i, m.group(3)))
                else:
                    for name in m.group(2).replace("(", " ").replace(")", " ").split(","):
                        name = name.split(" as ")[0].strip()
                        if name:
                            names.append((first + i, f"{m.group(1)}.{name}"))
        return names


def _clean(word: str) -> str:
    """A code word without the punctuation around it, a pytest node id or an anchor."""
    word = word.strip("\"'`,;()[]")
    word = word.rstrip(".:")
    return word.split("::")[0].split("#")[0]


# ---------------------------------------------------------------- headings


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    return anchors_of(Doc(path))


def anchors_of(doc: Doc) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line, prose_line in zip(doc.text.split("\n"), doc.prose.split("\n")):
        if not prose_line.strip():  # inside a fenced block (or blank)
            continue
        m = _HEADING.match(line)
        if m is None:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


# ---------------------------------------------------------------- the checks


def broken_links(doc: Doc, root: Path = ROOT) -> list[str]:
    problems = []
    for line, target in doc.links():
        if not target or _SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = doc.path if not path_part else (doc.path.parent / path_part).resolve()
        where = f"{doc.path.name}:{line}: ({target})"
        if not dest.exists():
            problems.append(f"{where} {path_part} does not exist")
        elif not str(dest).startswith(str(root.resolve())):
            problems.append(f"{where} points outside the repository")
        elif anchor:
            if dest.suffix != ".md" or dest.is_dir():
                problems.append(f"{where} an anchor into something that is not a Markdown file")
            elif anchor.lower() not in (anchors_of(doc) if dest == doc.path else anchors(dest)):
                problems.append(f"{where} {dest.name} has no heading #{anchor}")
    return problems


def missing_paths(doc: Doc, root: Path = ROOT) -> list[str]:
    problems = []
    for line, word in doc.code_tokens():
        word = _clean(word)
        m = _PATH.match(word)
        if m is None or any(c in word for c in "<>*{}$"):
            continue
        path = m.group(1).rstrip("/")
        if any(path == g or path.startswith(g + "/") for g in GENERATED):
            continue
        if not (root / path).exists():
            problems.append(f"{doc.path.name}:{line}: `{m.group(1)}` does not exist")
    return problems


def unknown_modules(doc: Doc) -> list[str]:
    problems = []
    names = [(line, _clean(word)) for line, word in doc.code_tokens()] + doc.python_imports()
    for line, word in names:
        m = _DOTTED.match(word)
        if m is None:
            continue
        dotted = m.group(1) + (f".{m.group(2)}" if m.group(2) else "")
        why = resolve(dotted)
        if why:
            problems.append(f"{doc.path.name}:{line}: `{word}`: {why}")
    return problems


@cache
def resolve(dotted: str) -> str | None:
    """None when `dotted` is a module of ours followed by names its source defines; else why not."""
    parts = dotted.split(".")
    spec = importlib.util.find_spec(parts[0])
    if spec is None:
        return f"no package {parts[0]}"
    i = 1
    while i < len(parts) and spec.submodule_search_locations is not None:
        name = ".".join(parts[: i + 1])
        try:
            sub = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            sub = None
        if sub is None:
            break
        spec, i = sub, i + 1
    module = ".".join(parts[:i])
    if i == len(parts):
        return None
    if spec.origin is None or not spec.origin.endswith(".py"):
        return f"{module} has no Python source to look for {'.'.join(parts[i:])} in"
    if not _defines(spec.origin, parts[i:]):
        return f"{module} has no submodule and defines no name {'.'.join(parts[i:])}"
    return None


def _defines(source: str, names: list[str]) -> bool:
    """Whether the module at `source` defines names[0] at top level, names[1] inside it (a class), ..."""
    body = ast.parse(Path(source).read_text()).body
    for name in names:
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name) and n.id == name:
                            found = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names
            ):
                found = node
        if found is None:
            return False
        body = found.body if isinstance(found, ast.ClassDef) else []
    return True


# ---------------------------------------------------------------- the documents

DOCS = doc_files()
IDS = [str(p.relative_to(ROOT)) for p in DOCS]


def test_the_documents_exist():
    for name in ("README.md", "docs/architecture.md", "docs/perf-notes.md"):
        assert (ROOT / name).is_file(), name


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_links_resolve(path):
    problems = broken_links(Doc(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_paths_exist(path):
    problems = missing_paths(Doc(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_modules_exist(path):
    problems = unknown_modules(Doc(path))
    assert not problems, "\n".join(problems)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; keep it a manual (< {README_MAX_LINES})"


# ---------------------------------------------------------------- the checks can fail


def _doc(tmp_path: Path, text: str, name: str = "doc.md") -> Doc:
    path = tmp_path / name
    path.write_text(text)
    return Doc(path)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n\n## A `code` section\n")
    doc = _doc(
        tmp_path,
        "[ok](there.md) and [ok](there.md#a-code-section) and [ok](#top)\n\n# Top\n"
        "[bad](missing.md) [bad](there.md#nowhere)\n[also\nbad](#gone)\n"
        "`[not a link](missing.md)`\n```\n[not a link](missing.md)\n```\n"
        "[web](https://example.com/x)\n",
    )
    problems = broken_links(doc, root=tmp_path)
    assert len(problems) == 3, problems
    assert "missing.md does not exist" in problems[0]
    assert "#nowhere" in problems[1] and "#gone" in problems[2]


def test_a_missing_path_is_found(tmp_path):
    doc = _doc(
        tmp_path,
        "`runtime/config.py`, `runtime/` and `perf/results/x.json` exist or are output;\n"
        "`runtime/no_such_module.py` and `python tests/no_such_test.py::test_x` do not.\n"
        "```bash\n.venv/bin/python scripts/no_such_script.sh --flag\n```\n",
    )
    problems = missing_paths(doc)
    assert [p.split("`")[1] for p in problems] == [
        "runtime/no_such_module.py",
        "tests/no_such_test.py",
        "scripts/no_such_script.sh",
    ], problems


def test_an_unknown_module_is_found(tmp_path):
    doc = _doc(
        tmp_path,
        "`runtime.config`, `runtime.app:app`, `protocol.record_bytes.take_records`,\n"
        "`runtime.config.ServerArgs.from_env` exist; `runtime.no_such_module`,\n"
        "`protocol.records.no_such_name` and `runtime.app:no_app` do not.\n"
        "```python\nfrom runtime.config import ServerArgs, no_such_thing\n```\n",
    )
    problems = unknown_modules(doc)
    assert [p.split("`")[1] for p in problems] == [
        "runtime.no_such_module",
        "protocol.records.no_such_name",
        "runtime.app:no_app",
        "runtime.config.no_such_thing",
    ], problems


def test_anchors_follow_github(tmp_path):
    doc = _doc(
        tmp_path,
        "# One request, step by step\n## 1. HTTP worker: parse, tokenize\n## `ipc/` and *rings*\n"
        "## Twice\n## Twice\n```\n# not a heading\n```\n",
    )
    assert anchors_of(doc) == {
        "one-request-step-by-step",
        "1-http-worker-parse-tokenize",
        "ipc-and-rings",
        "twice",
        "twice-1",
    }
