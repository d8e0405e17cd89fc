"""README.md runs: every fenced ```python and ```bash block is executed, offline, on CPU.

A block directly preceded by ``<!-- readme: skip (REASON) -->`` (GPU, multi-node, long-running
servers, signatures and fragments) is reported as a pytest skip with that reason, so what is not run
stays visible. The ``<!-- ci:test -->`` block is the test suite itself: it is skipped here (running
it from inside the suite would recurse); ``.ci/run`` runs it.

Python blocks run in README order in one interpreter with one shared namespace, as a reader pastes
them into one session (the "Many requests" block uses the quickstart's ``model`` and ``tok``); each
block is one test, and a block after a failed one still runs (its own failure names it). Bash blocks
run one by one under ``bash -euo pipefail`` with this interpreter's ``bin`` first on PATH, from an
empty folder. Budget: about a minute on 2 CPU cores.
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
SKIP = re.compile(r"^<!--\s*readme:\s*skip\s*\((?P<reason>.+)\)\s*-->$")
MARKER = re.compile(r"^<!--.*-->$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
RUN_LANGS = ("python", "bash")
TIMEOUT_S = 600
RECURSION = "the test suite itself (README's test command); .ci/run runs it, not this suite from inside"


@dataclass(frozen=True)
class Block:
    """One fenced block of README.md: its language, first code line (1-based), code, section and why
    it is not run (None: it runs)."""

    lang: str
    line: int
    code: str
    section: str
    skip: str | None

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:30]
        return f"L{self.line}-{self.lang}-{slug}"


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text`` with the HTML comment lines directly above it."""
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
            raise ValueError(f"README.md:{i + 1}: a fenced block that never closes")
        markers = []
        k = i - 1
        while k >= 0 and MARKER.match(lines[k].strip()):
            markers.append(lines[k].strip())
            k -= 1
        skip = next((m.group("reason") for m in map(SKIP.match, markers) if m is not None), None)
        if skip is None and "<!-- ci:test -->" in markers:
            skip = RECURSION
        blocks.append(Block(fence.group("lang"), i + 2, "\n".join(lines[i + 1:end]) + "\n", section, skip))
        i = end + 1
    return blocks


BLOCKS = [b for b in readme_blocks(README.read_text(encoding="utf-8")) if b.lang in RUN_LANGS]


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
    namespace = {"__name__": "__main__"}
    for b in blocks:
        print(f"=== README.md:{b['line']}", flush=True)
        try:
            exec(compile(b["code"], f"README.md:{b['line']}", "exec"), namespace)
            results[b["name"]] = None
        except BaseException:
            results[b["name"]] = traceback.format_exc()
        json.dump(results, open(sys.argv[2], "w"))
''')


@pytest.fixture(scope="module")
def python_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Run every python block that is not skipped, in order, in one interpreter; block name -> None
    (ran) or its traceback. A block missing from the result never ran (the interpreter died first)."""
    tmp = tmp_path_factory.mktemp("readme-python")
    todo = [{"name": b.name, "line": b.line, "code": b.code} for b in BLOCKS if b.lang == "python" and not b.skip]
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
    assert sum(1 for b in BLOCKS if b.lang == "python" and not b.skip) >= 3
    assert any(b.section == "Quickstart" and not b.skip for b in BLOCKS)


def test_skip_markers_are_well_formed() -> None:
    """A misspelt marker would silently run (or not skip) a block: every ``readme:`` comment must be
    the skip marker with a reason, directly above a fenced block."""
    lines = README.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        if "readme:" in line and line.strip().startswith("<!--"):
            assert SKIP.match(line.strip()), f"README.md:{n + 1}: write <!-- readme: skip (REASON) -->"
            k = n + 1
            while k < len(lines) and MARKER.match(lines[k].strip()):
                k += 1
            assert k < len(lines) and FENCE.match(lines[k]), f"README.md:{n + 1}: the marker is not above a block"


def test_parser_reads_markers_and_sections() -> None:
    text = "# T\n## Sec\n<!-- ci:test -->\n```bash\nx\n```\n<!-- readme: skip (no GPU) -->\n```python\ny\n```\n"
    blocks = readme_blocks(text)
    assert [(b.lang, b.line, b.code, b.section) for b in blocks] == [("bash", 5, "x\n", "Sec"),
                                                                     ("python", 9, "y\n", "Sec")]
    assert blocks[0].skip == RECURSION and blocks[1].skip == "no GPU"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.skip:
        pytest.skip(f"README.md:{block.line}: {block.skip}")
    if block.lang == "python":
        error = request.getfixturevalue("python_results")[block.name]
        assert error is None, f"README.md:{block.line} ({block.section}) failed:\n{error}"
        return
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, (f"README.md:{block.line} ({block.section}) exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
