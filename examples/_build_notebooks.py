"""Build the example notebooks from their mirrored scripts, so the two can never drift.

Each ``examples/NAME.py`` is the source of ``examples/NAME.ipynb``. The script is written in the
"percent" cell format (the one jupytext, VS Code and PyCharm understand):

- ``# %%`` starts a code cell; ``# %% tags=["parameters"]`` a code cell with tags;
- ``# %% [markdown]`` starts a markdown cell whose lines are comments (``# text``);
- lines before the first ``# %%`` are a script-only header (not copied into the notebook).

Cells get deterministic ids, so an unchanged script always gives the same cells. The notebooks
are committed executed (outputs and inline plots included); a notebook is *stale* when its cells'
sources, types, ids or tags differ from its script's (outputs are not compared). Usage, from the
repository root::

    python examples/_build_notebooks.py --execute  # rebuild and run every notebook, saving outputs
    python examples/_build_notebooks.py            # rewrite stale notebooks only, outputs cleared
    python examples/_build_notebooks.py --check    # exit 1, naming them, if a notebook is stale

``--execute`` needs nbclient, nbformat and ipykernel (``pip install -e ".[test]"``); it runs each
notebook in a ``python3`` kernel of this interpreter, one thread, offline, from a temporary
folder. Building and checking need only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parent
EXAMPLES = ("quickstart", "continuous_batching", "prefix_caching", "kernel_level", "grpo_trl")

_MARKER = re.compile(r"^# %%(?P<rest>.*)$")
_TAGS = re.compile(r"tags\s*=\s*(?P<tags>\[[^\]]*\])")
_METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def parse_cells(text: str) -> list[dict]:
    """The cells of a percent-format script: ``[{"cell_type", "source", "tags"}]`` in order."""
    cells: list[dict] = []
    current: dict | None = None
    for line in text.splitlines():
        marker = _MARKER.match(line)
        if marker:
            rest = marker.group("rest")
            tags_match = _TAGS.search(rest)
            tags = json.loads(tags_match.group("tags")) if tags_match else []
            kind = "markdown" if "[markdown]" in rest else "code"
            current = {"cell_type": kind, "lines": [], "tags": tags}
            cells.append(current)
        elif current is not None:
            current["lines"].append(line)
    out = []
    for cell in cells:
        lines = cell.pop("lines")
        if cell["cell_type"] == "markdown":
            lines = [_uncomment(line) for line in lines]
        while lines and not lines[0].strip():
            lines.pop(0)
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            raise ValueError(f"empty {cell['cell_type']} cell #{len(out)}: remove its '# %%' marker")
        cell["source"] = "\n".join(lines)
        out.append(cell)
    return out


def _uncomment(line: str) -> str:
    if line.startswith("# "):
        return line[2:]
    if line.rstrip() in ("#", ""):
        return ""
    raise ValueError(f"a markdown cell line must be a comment ('# ...'), got {line!r}")


def _source_lines(source: str) -> list[str]:
    lines = source.split("\n")
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]


def build_notebook(script: Path) -> str:
    """The notebook JSON text (nbformat 4.5, outputs cleared) generated from ``script``."""
    return dumps(build_dict(script))


def dumps(notebook: dict) -> str:
    """Notebook JSON as the builder writes it (stable key order and indentation)."""
    return json.dumps(notebook, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def build_dict(script: Path) -> dict:
    """The notebook (as a dict, outputs cleared) generated from ``script``."""
    cells = []
    for i, cell in enumerate(parse_cells(script.read_text(encoding="utf-8"))):
        entry: dict = {"cell_type": cell["cell_type"], "id": f"cell-{i:02d}"}
        entry["metadata"] = {"tags": cell["tags"]} if cell["tags"] else {}
        if cell["cell_type"] == "code":
            entry["execution_count"] = None
            entry["outputs"] = []
        entry["source"] = _source_lines(cell["source"])
        cells.append(entry)
    return {"cells": cells, "metadata": _METADATA, "nbformat": 4, "nbformat_minor": 5}


def cell_sources(notebook: dict) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """What the staleness check compares: each cell's type, id, source and tags (not outputs)."""
    out = []
    for cell in notebook.get("cells", []):
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        tags = tuple(cell.get("metadata", {}).get("tags", []))
        out.append((cell.get("cell_type", ""), cell.get("id", ""), text, tags))
    return out


def pairs(names: tuple[str, ...] = EXAMPLES) -> list[tuple[Path, Path]]:
    """(script, notebook) paths of every example."""
    return [(EXAMPLES_DIR / f"{name}.py", EXAMPLES_DIR / f"{name}.ipynb") for name in names]


def stale(names: tuple[str, ...] = EXAMPLES) -> list[str]:
    """Notebooks that are missing, unreadable, or whose cell sources differ from their script's."""
    out = []
    for script, notebook in pairs(names):
        try:
            current = json.loads(notebook.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            out.append(notebook.name)
            continue
        if cell_sources(current) != cell_sources(build_dict(script)):
            out.append(notebook.name)
    return out


def kernel_env(workdir: Path) -> dict[str, str]:
    """Environment the notebooks run in: one thread, offline, no progress bars, temp files in workdir."""
    return {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "TMPDIR": str(workdir),
        "PYTHONPATH": os.pathsep.join(p for p in (str(EXAMPLES_DIR.parent), os.environ.get("PYTHONPATH")) if p),
    }


def execute(script: Path, timeout: int = 600) -> dict:
    """Build the notebook of ``script`` and run it top to bottom; returns it with its outputs."""
    import nbclient
    import nbformat

    notebook = nbformat.reads(build_notebook(script), as_version=4)
    saved = {k: os.environ.get(k) for k in kernel_env(Path("."))}
    with tempfile.TemporaryDirectory(prefix="flashpage-nb-") as workdir:
        os.environ.update(kernel_env(Path(workdir)))  # the kernel inherits this process's environment
        try:
            client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=timeout, record_timing=False,
                                             resources={"metadata": {"path": workdir}})
            client.execute()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return _tidy(json.loads(nbformat.writes(notebook)), workdir)


def _tidy(notebook: dict, workdir: str) -> dict:
    """Keep outputs, drop what changes from run to run without meaning (kernel metadata, temp paths)."""
    notebook["metadata"] = _METADATA
    for cell in notebook["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if "outputs" in cell:
            cell["outputs"] = _merge_streams([o for o in cell["outputs"] if not _is_noise(o)])
        for output in cell.get("outputs", []):
            _scrub(output, workdir)
    return notebook


def _merge_streams(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join consecutive prints to the same stream (a streamed generation is one output, not 40)."""
    merged: list[dict[str, Any]] = []
    for output in outputs:
        last = merged[-1] if merged else None
        if (last is not None and output.get("output_type") == last.get("output_type") == "stream"
                and output.get("name") == last.get("name")):
            last["text"] = ("".join(last["text"]) + "".join(output["text"])).splitlines(keepends=True)
        else:
            merged.append(output)
    return merged


_NOISE = re.compile(r"^.*TqdmWarning: IProgress not found.*\n\s*from \.autonotebook import tqdm as notebook_tqdm\n?",
                    re.MULTILINE)


def _is_noise(output: dict[str, Any]) -> bool:
    """tqdm's warning that ipywidgets is missing (it names this machine's paths): left out."""
    if output.get("output_type") != "stream" or output.get("name") != "stderr":
        return False
    text = "".join(output.get("text", ""))
    cleaned = _NOISE.sub("", text)
    output["text"] = cleaned
    return not cleaned.strip()


def _scrub(output: dict[str, Any], workdir: str) -> None:
    if "text" in output:
        output["text"] = _replace(output["text"], workdir)
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/"):
            output["data"][mime] = _replace(value, workdir)


def _replace(text: str | list[str], workdir: str) -> str | list[str]:
    real = os.path.realpath(workdir)
    fix = (lambda t: t.replace(real, "$TMPDIR").replace(workdir, "$TMPDIR"))
    return [fix(t) for t in text] if isinstance(text, list) else fix(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report stale notebooks (exit 1 if any)")
    mode.add_argument("--execute", action="store_true", help="rebuild and run every notebook, saving its outputs")
    parser.add_argument("names", nargs="*", choices=[[], *EXAMPLES], metavar="NAME",
                        help=f"only these examples ({', '.join(EXAMPLES)}); default all")
    args = parser.parse_args(argv)
    names = tuple(args.names) or EXAMPLES
    if args.check:
        out_of_date = stale(names)
        for name in out_of_date:
            print(f"{name} is out of date: run python examples/_build_notebooks.py --execute", file=sys.stderr)
        return 1 if out_of_date else 0
    for script, notebook in pairs(names):
        if args.execute:
            notebook.write_text(dumps(execute(script)), encoding="utf-8")
            print(f"executed {notebook.relative_to(EXAMPLES_DIR.parent)} ({notebook.stat().st_size // 1024} KiB)")
        elif notebook.name in stale((script.stem,)):
            notebook.write_text(build_notebook(script), encoding="utf-8")
            print(f"wrote {notebook.relative_to(EXAMPLES_DIR.parent)} (outputs cleared: run with --execute)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
