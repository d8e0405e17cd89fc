"""Build the example notebooks from their mirrored scripts, so the two can never drift.

Each ``examples/NAME.py`` is the source of ``examples/NAME.ipynb``. The script is written in the
"percent" cell format (the one jupytext, VS Code and PyCharm understand):

- ``# %%`` starts a code cell; ``# %% tags=["parameters"]`` a code cell with tags;
- ``# %% [markdown]`` starts a markdown cell whose lines are comments (``# text``);
- lines before the first ``# %%`` are a script-only header (not copied into the notebook).

The notebooks are written with outputs cleared and deterministic cell ids, so rebuilding an
unchanged script gives a byte-identical notebook. Usage, from the repository root::

    python examples/_build_notebooks.py          # rewrite every notebook from its script
    python examples/_build_notebooks.py --check  # exit 1, naming them, if a notebook is stale

Only the standard library is needed (no nbformat, no jupytext).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parent
EXAMPLES = ("quickstart", "continuous_batching", "prefix_caching", "kernel_level")

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
    cells = []
    for i, cell in enumerate(parse_cells(script.read_text(encoding="utf-8"))):
        entry: dict = {"cell_type": cell["cell_type"], "id": f"cell-{i:02d}"}
        entry["metadata"] = {"tags": cell["tags"]} if cell["tags"] else {}
        if cell["cell_type"] == "code":
            entry["execution_count"] = None
            entry["outputs"] = []
        entry["source"] = _source_lines(cell["source"])
        cells.append(entry)
    notebook = {"cells": cells, "metadata": _METADATA, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(notebook, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def pairs(names: tuple[str, ...] = EXAMPLES) -> list[tuple[Path, Path]]:
    """(script, notebook) paths of every example."""
    return [(EXAMPLES_DIR / f"{name}.py", EXAMPLES_DIR / f"{name}.ipynb") for name in names]


def stale(names: tuple[str, ...] = EXAMPLES) -> list[str]:
    """Notebooks that are missing or differ from what their script generates."""
    out = []
    for script, notebook in pairs(names):
        if not notebook.is_file() or notebook.read_text(encoding="utf-8") != build_notebook(script):
            out.append(notebook.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale notebooks (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        out_of_date = stale()
        for name in out_of_date:
            print(f"{name} is out of date: run python examples/_build_notebooks.py", file=sys.stderr)
        return 1 if out_of_date else 0
    for script, notebook in pairs():
        notebook.write_text(build_notebook(script), encoding="utf-8")
        print(f"wrote {notebook.relative_to(EXAMPLES_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
