"""The example notebooks (examples/*.ipynb) and their mirrored scripts (examples/*.py).

- the notebooks' cells are exactly what ``examples/_build_notebooks.py`` generates from the
  scripts (sources, ids and tags: the two cannot drift), with one ``parameters`` cell near the
  top, and they are saved executed (``--execute``): every code cell ran, without errors, plots
  are shown inline, and the files stay small;
- every notebook runs top to bottom with nbclient in a ``python3`` kernel of this interpreter,
  its parameter cell overridden papermill-style (an injected cell right after it);
- every script runs as a subprocess of ``sys.executable``, and so does README's quickstart.

The examples assert what they show (identical tokens, prefix hits, shared blocks, kernels equal
to dense attention...), so running them successfully is the test. One thread, offline, and
TMPDIR inside pytest's tmp dir so the plots they write land there.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = ROOT / "examples"
NAMES = ("quickstart", "continuous_batching", "prefix_caching", "kernel_level", "grpo_trl")
PLOTS = {"continuous_batching": "throughput.png", "prefix_caching": "prefix_blocks.png", "grpo_trl": "grpo_rewards.png"}
NEEDS = {"grpo_trl": "trl"}  # examples of optional extras: skipped (visibly) without them
CELL_TIMEOUT_S = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_NOTEBOOK_BYTES = 400 * 1024


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
        "FLASHPAGE_EXAMPLE_STEPS": "3",  # grpo_trl: 3 GRPO steps per run instead of the saved notebook's 24
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
def test_notebook_is_executed_with_one_parameter_cell(name: str) -> None:
    nb = _notebook(name)
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    rerun = "run python examples/_build_notebooks.py --execute"
    counts = [c["execution_count"] for c in code]
    assert all(isinstance(n, int) for n in counts), f"{name}: saved without outputs: {rerun}"
    assert counts == sorted(counts) and len(set(counts)) == len(counts), f"{name}: cells ran out of order: {rerun}"
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"], f"{name}: saved with an error"
    assert any(o.get("name") == "stdout" for o in outputs), f"{name}: no printed output saved"
    if name in PLOTS:
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}: its plot is not shown inline"
    size = (EXAMPLES_DIR / f"{name}.ipynb").stat().st_size
    assert size < MAX_NOTEBOOK_BYTES, f"{name}.ipynb is {size // 1024} KiB: keep plots at a modest dpi"
    tagged = [i for i, c in enumerate(nb["cells"]) if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, f"{name}: expected exactly one cell tagged 'parameters', found {len(tagged)}"
    assert tagged[0] <= 2 and nb["cells"][tagged[0]]["cell_type"] == "code"
    names = _parameter_names("".join(nb["cells"][tagged[0]]["source"]))
    assert {"DEVICE", "DTYPE"} <= names
    if name != "kernel_level":
        assert "MODEL" in names
    assert any(" assert " in f" {line}" for c in code for line in "".join(c["source"]).splitlines())


def test_staleness_compares_sources_not_outputs() -> None:
    builder = _builder()
    script = EXAMPLES_DIR / "quickstart.py"
    built = builder.build_dict(script)
    executed = _notebook("quickstart")
    assert builder.cell_sources(executed) == builder.cell_sources(built)  # outputs do not count
    executed["cells"][-1]["source"] = ["print('edited')"]
    assert builder.cell_sources(executed) != builder.cell_sources(built)  # a source edit does
    executed = _notebook("quickstart")
    executed["cells"][1]["metadata"]["tags"] = []
    assert builder.cell_sources(executed) != builder.cell_sources(built)  # and so does a lost tag


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
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{name} needs {NEEDS[name]}: pip install 'flashpage[rl]'")
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
        shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
        assert shown, f"{name}: the plot was written but not displayed in the notebook"


@pytest.mark.parametrize("name", NAMES)
def test_script_runs(name: str, tmp_path: Path) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{name} needs {NEEDS[name]}: pip install 'flashpage[rl]'")
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


def test_readme_quickstart_runs(tmp_path: Path) -> None:
    """README's quickstart code block, as written: token-identical, and the pages use less memory."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", readme, re.S)
    assert block, "README.md has no quickstart python block"
    script = tmp_path / "readme_quickstart.py"
    script.write_text(block.group(1), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=CELL_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saving = re.search(r"([0-9.]+)x less KV memory", proc.stdout)
    assert saving and float(saving.group(1)) > 1.3, proc.stdout
