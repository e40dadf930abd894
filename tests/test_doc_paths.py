"""Paths the documentation names exist in the repository.

What is read: every tracked Markdown file, whole (README.md, docs/, docker/README.md, ...), and in
every tracked Python file (generated protobuf modules aside) its comments and its docstrings
(module, class, function). What counts as naming a path there:

1. A repository path: a run of the characters `A-Z a-z 0-9 _ . * / -` that holds a `/`, does not
   start with one (absolute paths and the tails of URLs are not the repository's), and whose first
   part is a top-level folder of the repository (one that holds tracked files), e.g.
   `services/launch_server.py`, `engine/tp/`, `docs/architecture.md`. A leading `./` and the
   trailing `.` `,` `:` `;` of a sentence are dropped; a `*` makes it a glob that must match something.
   So `.cache/models/tiny` (not tracked), `/tmp/kv4` and `prefill/decode` (no such top-level
   folder) are prose, not paths.
2. A root document: a word ending in `.md` with no `/` (such as `README.md`) must exist at
   the repository root or beside the file that names it.
3. A Markdown link: the target of `[text](target)` or `![alt](target)`, unless it is a URL
   (`scheme:`), must exist relative to the Markdown file's own folder, and its `#anchor`, if any,
   must name a heading of the Markdown file it points to (as GitHub spells it: lower case,
   punctuation dropped, spaces as `-`).
4. A module run with `python -m NAME` whose first part is a top-level folder must be a module of
   the repository (NAME/ as a package or NAME.py, dots read as `/`).

Each must exist in the working tree, unless git ignores it (a build's output, such as
docker/.context/) or it is a file the operator writes (`WRITTEN_BY_THE_OPERATOR`).
`EXPECTED_MISSING` lists paths the documentation names ahead of code that is still moving into the
layout docs/architecture.md describes; each entry leaves the list when its code lands (a test fails
while a listed path exists), and the list ends empty.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Named by the documentation, not in the tree yet: their code is being moved there. Empty it.
EXPECTED_MISSING: frozenset[str] = frozenset()

# Files the docs tell an operator to create; the repository never holds them.
WRITTEN_BY_THE_OPERATOR: frozenset[str] = frozenset({"docker/.env", "docker/compose.override.yaml"})

_PATH = re.compile(r"(?<![A-Za-z0-9_.*/-])[A-Za-z0-9_.*-]*/[A-Za-z0-9_.*/-]*")
_ROOT_DOC = re.compile(r"(?<![A-Za-z0-9_./-])[A-Za-z0-9_-]+\.md(?![A-Za-z0-9_/-])")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_MODULE = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def _top_folders(tracked: list[str]) -> set[str]:
    return {name.split("/", 1)[0] for name in tracked if "/" in name}


def _exists(relative: str) -> bool:
    if "*" in relative:
        return any(ROOT.glob(relative))
    return (ROOT / relative).exists()


def _ignored(relative: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", relative], cwd=ROOT).returncode == 0


def _python_text(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each comment and each docstring line of a Python file."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                for number in range(first.lineno, first.end_lineno + 1):
                    yield number, lines[number - 1]


def _references(text: str, top: set[str]) -> Iterator[tuple[str, str]]:
    """(what was written, the repository-relative path it names) in one line of documentation."""
    for match in _PATH.finditer(text):
        written = match.group(0).rstrip(".,:;")
        relative = written[2:] if written.startswith("./") else written
        if relative.split("/", 1)[0] in top:
            yield written, relative
    for match in _MODULE.finditer(text):
        name = match.group(1).rstrip(".")
        if name.split(".", 1)[0] in top:
            yield f"python -m {name}", name.replace(".", "/")


def _module_exists(relative: str) -> bool:
    return (ROOT / relative).is_dir() or (ROOT / f"{relative}.py").is_file()


def _offenders_in(relative_file: str, numbered_lines: Iterator[tuple[int, str]], top: set[str],
                  markdown: bool) -> Iterator[tuple[str, str]]:
    """(file:line, missing reference) for one file."""
    folder = (ROOT / relative_file).parent
    for number, line in numbered_lines:
        where = f"{relative_file}:{number}"
        for written, relative in _references(line, top):
            if written.startswith("python -m "):
                found = _module_exists(relative)
            else:
                found = _exists(relative) or relative in WRITTEN_BY_THE_OPERATOR or _ignored(relative)
            if not found:
                yield where, written
        for match in _ROOT_DOC.finditer(line):
            name = match.group(0)
            if not (ROOT / name).exists() and not (folder / name).exists():
                yield where, name
        if markdown:
            for match in _LINK.finditer(line):
                if not _link_resolves(folder, relative_file, match.group(1)):
                    yield where, f"link {match.group(1)}"


def _anchors(markdown: Path) -> set[str]:
    """GitHub's ids for the headings of a Markdown file."""
    ids = set()
    for line in markdown.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            ids.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return ids


def _link_resolves(folder: Path, relative_file: str, link: str) -> bool:
    if _SCHEME.match(link):
        return True
    target, _, anchor = link.partition("#")
    path = folder / target if target else ROOT / relative_file
    if not path.exists():
        return False
    return not anchor or path.suffix != ".md" or anchor in _anchors(path)


def _all_offenders() -> list[tuple[str, str]]:
    tracked = _tracked()
    top = _top_folders(tracked)
    found = []
    for name in tracked:
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not committed yet
            continue
        if name.endswith(".md"):
            found += _offenders_in(name, enumerate(path.read_text().splitlines(), start=1), top,
                                   markdown=True)
        elif name.endswith(".py") and "_pb2" not in name:
            found += _offenders_in(name, _python_text(path), top, markdown=False)
    return found


def _missing_name(reference: str) -> str:
    return reference.removeprefix("python -m ").removeprefix("link ").removeprefix("./")


def test_documented_paths_exist():
    offenders = [(where, ref) for where, ref in _all_offenders()
                 if _missing_name(ref) not in EXPECTED_MISSING]
    assert not offenders, "documentation names paths that do not exist (see this test's docstring):\n" + \
        "\n".join(f"  {where}: {ref}" for where, ref in sorted(set(offenders)))


def test_expected_missing_paths_are_still_missing():
    landed = sorted(name for name in EXPECTED_MISSING
                    if _exists(name) or _module_exists(name.replace(".", "/")))
    assert not landed, "these now exist: remove them from EXPECTED_MISSING in tests/test_doc_paths.py:\n" + \
        "\n".join(f"  {name}" for name in landed)


def test_the_rule_reads_paths_as_documented():
    top = {"services", "engine", "docs"}
    refs = [ref for _, ref in _references(
        "see services/gateway/app.py, engine/tp/ and ./docs/x.md. Not /tmp/kv4, .cache/models/tiny, "
        "prefill/decode or http://127.0.0.1:8000/v1/chat; run python -m engine.bench_x.", top)]
    assert refs == ["services/gateway/app.py", "engine/tp/", "docs/x.md", "engine/bench_x"]
    assert [m.group(0) for m in _ROOT_DOC.finditer("cites ARCHITECTURE.md and docs/a.md")] \
        == ["ARCHITECTURE.md"]
    docs = ROOT / "docs"
    assert _link_resolves(docs, "docs/failures.md", "engine.md#the-engine")
    assert not _link_resolves(docs, "docs/failures.md", "architecture.md#no-such-heading")
    assert not _link_resolves(docs, "docs/failures.md", "no-such-page.md")
    assert _link_resolves(docs, "docs/failures.md", "https://example.com/x.md")
