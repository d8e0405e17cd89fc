"""The example notebooks (examples/*.ipynb) and their mirrored scripts (examples/*.py).

- the notebooks are exactly what ``examples/_build_notebooks.py`` generates from the scripts
  (so the two cannot drift), with outputs cleared and one ``parameters`` cell near the top;
- every notebook runs top to bottom with nbclient in a ``python3`` kernel of this interpreter,
  its parameter cell overridden papermill-style (an injected cell right after it);
- every script runs as a subprocess of ``sys.executable``.

The examples assert what they show (identical tokens, prefix hits, shared blocks, kernels equal
to dense attention...), so running them successfully is the test. One thread, offline, and
TMPDIR inside pytest's tmp dir so the plots they write land there.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = ROOT / "examples"
NAMES = ("quickstart", "continuous_batching", "prefix_caching", "kernel_level")
PLOTS = {"continuous_batching": "throughput.png", "prefix_caching": "prefix_blocks.png"}
CELL_TIMEOUT_S = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_build_notebooks", EXAMPLES_DIR / "_build_notebooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env(tmp_path: Path) -> dict[str, str]:
    """Environment of a child process (script or kernel): one thread, offline, temp files in tmp_path."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        "TMPDIR": str(tmp_path),
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def _notebook(name: str) -> dict:
    return json.loads((EXAMPLES_DIR / f"{name}.ipynb").read_text(encoding="utf-8"))


def _parameter_names(cell_source: str) -> set[str]:
    names = set()
    for stmt in ast.parse(cell_source).body:
        assert isinstance(stmt, ast.Assign), f"the parameters cell may only assign values, got {ast.dump(stmt)[:80]}"
        names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return names


def _png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"


# ----------------------------------------------------------------------------------- static checks
def test_notebooks_are_generated_from_the_scripts() -> None:
    builder = _builder()
    assert tuple(builder.EXAMPLES) == NAMES
    stale = builder.stale()
    assert not stale, f"{stale} out of date with their scripts: run python examples/_build_notebooks.py"
    assert builder.main(["--check"]) == 0


def test_builder_parses_percent_cells() -> None:
    builder = _builder()
    text = (
        "# script-only header\n"
        "# %% [markdown]\n# # Title\n#\n# Some *text*.\n\n"
        '# %% tags=["parameters"]\nN = 2  # size\n\n'
        "# %%\nprint(N)\n\n\nx = 1\n"
    )
    cells = builder.parse_cells(text)
    assert cells == [
        {"cell_type": "markdown", "tags": [], "source": "# Title\n\nSome *text*."},
        {"cell_type": "code", "tags": ["parameters"], "source": "N = 2  # size"},
        {"cell_type": "code", "tags": [], "source": "print(N)\n\n\nx = 1"},
    ]
    with pytest.raises(ValueError, match="comment"):
        builder.parse_cells("# %% [markdown]\nnot a comment\n")


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_cleared_with_one_parameter_cell(name: str) -> None:
    nb = _notebook(name)
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for cell in code:
        assert cell["outputs"] == [] and cell["execution_count"] is None, "commit notebooks with outputs cleared"
    tagged = [i for i, c in enumerate(nb["cells"]) if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, f"{name}: expected exactly one cell tagged 'parameters', found {len(tagged)}"
    assert tagged[0] <= 2 and nb["cells"][tagged[0]]["cell_type"] == "code"
    names = _parameter_names("".join(nb["cells"][tagged[0]]["source"]))
    assert {"DEVICE", "DTYPE"} <= names
    if name != "kernel_level":
        assert "MODEL" in names
    assert any(" assert " in f" {line}" for c in code for line in "".join(c["source"]).splitlines())


# ------------------------------------------------------------------------------------------ running
@pytest.fixture(scope="module")
def nbclient_modules() -> tuple[ModuleType, ModuleType]:
    try:
        import ipykernel  # noqa: F401  (the kernel the notebooks run in)
        import nbclient
        import nbformat
    except ImportError as exc:
        pytest.skip(f"running the notebooks needs nbclient, nbformat and ipykernel ({exc}); pip install -e '.[test]'")
    return nbclient, nbformat


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbclient_modules) -> None:
    nbclient, nbformat = nbclient_modules
    if name in PLOTS:
        pytest.importorskip("matplotlib", reason=f"{name} draws its plot with matplotlib")
    for key, value in _env(tmp_path).items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    nb = nbformat.read(EXAMPLES_DIR / f"{name}.ipynb", as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    overrides = {}
    if "OUTPUT_DIR" in _parameter_names(nb.cells[index].source):
        overrides["OUTPUT_DIR"] = str(tmp_path / "out")
    injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in overrides.items()))
    injected.metadata["tags"] = ["injected-parameters"]
    probe = nbformat.v4.new_code_cell(
        "import json, sys\nimport flashpage\nprint(json.dumps({'prefix': sys.prefix, 'flashpage': flashpage.__file__}))"
    )
    nb.cells.insert(index + 1, injected)
    nb.cells.insert(0, probe)

    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    seen = json.loads(nb.cells[0].outputs[0]["text"])
    import flashpage

    assert seen == {"prefix": sys.prefix, "flashpage": flashpage.__file__}, "the kernel is not this interpreter"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
    if name in PLOTS:
        _png(tmp_path / "out" / PLOTS[name])


@pytest.mark.parametrize("name", NAMES)
def test_script_runs(name: str, tmp_path: Path) -> None:
    if name in PLOTS:
        pytest.importorskip("matplotlib", reason=f"{name} draws its plot with matplotlib")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / f"{name}.py")],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=CELL_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, (
        f"examples/{name}.py exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    assert proc.stdout.strip()
    if name in PLOTS:  # OUTPUT_DIR = None: a new folder under TMPDIR
        found = sorted(tmp_path.glob(f"flashpage-examples-*/{PLOTS[name]}"))
        assert len(found) == 1, found
        _png(found[0])
