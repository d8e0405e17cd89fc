"""README.md and docs/*.md run: every fenced ```python and ```bash block is executed, offline, on CPU.

A block directly preceded by ``<!-- readme: skip (REASON) -->`` (GPU, multi-node, long-running
servers, signatures and fragments) is reported as a pytest skip with that reason, so what is not run
stays visible. The ``<!-- ci:test -->`` block is the test suite itself: it is skipped here (running
it from inside the suite would recurse); ``.ci/run`` runs it.

Python blocks run in one interpreter (README first, then the docs pages by name), page by page: the
blocks of one page run in order in one shared namespace, as a reader pastes them into one session
(README's "Many requests" block uses the quickstart's ``model`` and ``tok``), and each page starts from
a fresh namespace. Each block is one test, and a block after a failed one still runs (its own failure
names it). Bash blocks run one by one under ``bash -euo pipefail`` with this interpreter's ``bin`` first
on PATH, from an empty folder. Budget: about a minute on 2 CPU cores.

Also checked here: the README stays a front door (at most ``README_MAX_LINES`` lines, the CI markers
in place), and every relative link of README.md and docs/*.md points to an existing file and, where it
names one, to a heading of that page.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
SKIP = re.compile(r"^<!--\s*readme:\s*skip\s*\((?P<reason>.+)\)\s*-->$")
MARKER = re.compile(r"^<!--.*-->$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
RUN_LANGS = ("python", "bash")
TIMEOUT_S = 600
RECURSION = "the test suite itself (README's test command); .ci/run runs it, not this suite from inside"


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, first code line (1-based), code, section, why it is
    not run (None: it runs) and the page (a path relative to the repository root)."""

    lang: str
    line: int
    code: str
    section: str
    skip: str | None
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:30]
        prefix = "" if self.page == "README.md" else Path(self.page).stem + "-"
        return f"{prefix}L{self.line}-{self.lang}-{slug}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Every fenced block of ``text`` (the page ``page``) with the HTML comment lines directly above it."""
    lines = text.splitlines()
    blocks: list[Block] = []
    section = "top"
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        fence = FENCE.match(line)
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a fenced block that never closes")
        markers = []
        k = i - 1
        while k >= 0 and MARKER.match(lines[k].strip()):
            markers.append(lines[k].strip())
            k -= 1
        skip = next((m.group("reason") for m in map(SKIP.match, markers) if m is not None), None)
        if skip is None and "<!-- ci:test -->" in markers:
            skip = RECURSION
        blocks.append(Block(fence.group("lang"), i + 2, "\n".join(lines[i + 1:end]) + "\n", section, skip, page))
        i = end + 1
    return blocks


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


BLOCKS = [b for page in PAGES for b in readme_blocks(page.read_text(encoding="utf-8"), _rel(page))
          if b.lang in RUN_LANGS]


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg", "TMPDIR": str(tmp),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


RUNNER = textwrap.dedent('''
    import json, sys, traceback
    blocks = json.load(open(sys.argv[1]))
    results = {}
    page = None
    for b in blocks:
        if b["page"] != page:  # each page starts from a fresh namespace
            page, namespace = b["page"], {"__name__": "__main__"}
        print(f"=== {b['page']}:{b['line']}", flush=True)
        try:
            exec(compile(b["code"], f"{b['page']}:{b['line']}", "exec"), namespace)
            results[b["name"]] = None
        except BaseException:
            results[b["name"]] = traceback.format_exc()
        json.dump(results, open(sys.argv[2], "w"))
''')


@pytest.fixture(scope="module")
def python_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Run every python block that is not skipped, page by page and in order, in one interpreter; block
    name -> None (ran) or its traceback. A block missing from the result never ran (the interpreter died
    first)."""
    tmp = tmp_path_factory.mktemp("readme-python")
    todo = [{"name": b.name, "page": b.page, "line": b.line, "code": b.code}
            for b in BLOCKS if b.lang == "python" and not b.skip]
    (tmp / "blocks.json").write_text(json.dumps(todo), encoding="utf-8")
    (tmp / "runner.py").write_text(RUNNER, encoding="utf-8")
    proc = subprocess.run([sys.executable, "runner.py", "blocks.json", "results.json"], cwd=tmp, env=_env(tmp),
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    results = json.loads((tmp / "results.json").read_text()) if (tmp / "results.json").exists() else {}
    for item in todo:
        if item["name"] not in results:
            results[item["name"]] = f"never ran: the interpreter exited {proc.returncode}\n{proc.stderr[-3000:]}"
    return results


def test_readme_has_runnable_blocks() -> None:
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert sum(1 for b in readme if b.lang == "python" and not b.skip) >= 2
    assert any(b.section == "Quickstart" and not b.skip for b in readme)
    assert sum(1 for b in BLOCKS if b.lang == "python" and not b.skip) >= 5  # the docs pages' too


def test_readme_is_a_front_door() -> None:
    """README.md stays short (the rest lives in docs/), and keeps what .ci/run reads from it: a bash block
    after each of the ci:main and ci:test markers."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): "
                                            "move text to docs/")
    for marker in ("<!-- ci:main -->", "<!-- ci:test -->"):
        assert marker in lines, f"README.md lost its {marker} marker"
        after = lines[lines.index(marker) + 1:]
        fence = next(line for line in after if line.startswith("```"))
        assert fence == "```bash", f"the first block after {marker} must be ```bash, got {fence!r}"


@pytest.mark.parametrize("page", PAGES, ids=[_rel(p) for p in PAGES])
def test_skip_markers_are_well_formed(page: Path) -> None:
    """A misspelt marker would silently run (or not skip) a block: every ``readme:`` comment must be
    the skip marker with a reason, directly above a fenced block."""
    lines = page.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        if "readme:" in line and line.strip().startswith("<!--"):
            assert SKIP.match(line.strip()), f"{_rel(page)}:{n + 1}: write <!-- readme: skip (REASON) -->"
            k = n + 1
            while k < len(lines) and MARKER.match(lines[k].strip()):
                k += 1
            assert k < len(lines) and FENCE.match(lines[k]), f"{_rel(page)}:{n + 1}: the marker is not above a block"


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the Markdown headings of ``text`` (lowercase; punctuation other than ``-`` and
    ``_`` dropped; spaces to ``-``; repeats get ``-1``, ``-2``...), outside fenced blocks."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    infence = False
    for line in text.splitlines():
        if line.startswith("```"):
            infence = not infence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if infence or m is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link of ``text`` that is not a URL, outside code (a link's text
    may wrap onto the next line)."""
    lines, infence = [], False
    for line in text.splitlines():
        fence = line.startswith("```")
        infence ^= fence
        lines.append("" if fence or infence else re.sub(r"`[^`]*`", "", line))
    prose = "\n".join(lines)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(prose)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(1))]


def test_link_checker_reads_anchors_and_links() -> None:
    text = "# A title\n## The `LLM(...)` options\n## Q&A: why?\n## Q&A: why?\n```\n# not a heading\n```\n"
    assert heading_anchors(text) == {"a-title", "the-llm-options", "qa-why", "qa-why-1"}
    links = "[a](x.md#b) `[c](d.md)` [e](https://f) ![g](h.png)\n```\n[i](j.md)\n```\n[k\nl](m.md)\n"
    assert relative_links(links) == [(1, "x.md#b"), (5, "m.md")]


@pytest.mark.parametrize("page", PAGES, ids=[_rel(p) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link points to an existing file, and an anchor to a heading of that page."""
    text = page.read_text(encoding="utf-8")
    broken = []
    for line, target in relative_links(text):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{_rel(page)}:{line}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{_rel(page)}:{line}: {target}: {_rel(dest)} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


def test_parser_reads_markers_and_sections() -> None:
    text = "# T\n## Sec\n<!-- ci:test -->\n```bash\nx\n```\n<!-- readme: skip (no GPU) -->\n```python\ny\n```\n"
    blocks = readme_blocks(text)
    assert [(b.lang, b.line, b.code, b.section) for b in blocks] == [("bash", 5, "x\n", "Sec"),
                                                                     ("python", 9, "y\n", "Sec")]
    assert blocks[0].skip == RECURSION and blocks[1].skip == "no GPU"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.skip:
        pytest.skip(f"{block.where}: {block.skip}")
    if block.lang == "python":
        error = request.getfixturevalue("python_results")[block.name]
        assert error is None, f"{block.where} ({block.section}) failed:\n{error}"
        return
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, (f"{block.where} ({block.section}) exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
