"""`flashpage bench generate|engine --quick --json --plot`: fields exist, are positive, outputs agree.

Each command runs once in a subprocess (one thread: the quick runs are small, and a shared CI
machine makes multi-threaded BLAS spin). Speed is measured by the benchmarks, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, *args: str) -> tuple[dict, Path]:
    plot = tmp_path / "plot.png"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "flashpage.cli", "bench", *args, "--quick", "--json",
                           "--plot", str(plot)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                                  f"stderr:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), plot


def _positive(d: dict, *keys: str) -> None:
    for k in keys:
        assert k in d, f"missing field {k!r}"
        assert isinstance(d[k], (int, float)) and not isinstance(d[k], bool), f"{k} = {d[k]!r} is not a number"
        assert d[k] > 0, f"{k} = {d[k]!r} is not positive"


def _png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_generate_quick(tmp_path: Path) -> None:
    result, plot = _bench(tmp_path, "generate")
    assert result["bench"] == "generate" and result["quick"] is True
    assert set(result["cases"]) == {"short", "long"}
    assert result["cases"]["long"]["new_tokens"] == 256
    for name, case in result["cases"].items():
        _positive(case, "seconds_unpatched", "seconds_patched", "ratio", "tok_s_unpatched", "tok_s_patched",
                  "dense_kv_bytes", "paged_kv_bytes_in_use", "paged_kv_bytes_allocated", "kv_bound_bytes",
                  "kv_real_tokens", "block_size")
        assert case["outputs_agree"] is True, (name, case["mismatches"])
        assert case["kv_within_bound"] is True, name
        assert case["paged_kv_bytes_in_use"] <= case["kv_bound_bytes"], name
        assert case["kv_tokens_as_expected"] is True, name
        assert case["paged_kv_bytes_in_use"] <= case["paged_kv_bytes_allocated"]
    assert result["outputs_agree"] is True and result["kv_within_bound"] is True
    assert set(result["goals"]) >= {"short_no_slower", "long_faster", "kv_within_bound"}
    _png(plot)


def test_bench_engine_quick_shared_prefix(tmp_path: Path) -> None:
    result, plot = _bench(tmp_path, "engine", "--workload", "shared-prefix")
    assert result["bench"] == "engine" and result["workload"] == "shared-prefix"
    assert set(result["systems"]) == {"flashpage", "hf_generate", "hf_cb"}
    for name, s in result["systems"].items():
        _positive(s, "output_tokens_per_s", "seconds", "output_tokens", "ttft_p50_s", "ttft_p90_s",
                  "tpot_p50_s", "tpot_p90_s", "peak_kv_bytes")
        assert s["ttft_p50_s"] <= s["ttft_p90_s"] and s["tpot_p50_s"] <= s["tpot_p90_s"], name
        assert s["output_tokens"] == result["useful_output_tokens"], name
        assert s["lengths_ok"] is True, name
        if name != "hf_generate":
            assert s["outputs_agree"] is True, (name, s["mismatches"])
            assert s["agreeing_requests"] == result["requests"], name
    fp = result["systems"]["flashpage"]
    assert 0.0 <= fp["prefix_cache_hit_rate"] <= 1.0
    assert fp["peak_kv_bytes"] <= fp["kv_bytes_allocated"]
    _positive(result["ratios"], "flashpage_vs_hf_generate", "flashpage_vs_hf_cb")
    assert "flashpage_vs_hf_generate" in result["goals"]
    assert result["outputs_agree"] is True
    _png(plot)


@pytest.mark.parametrize("quick", [True, False])
def test_long_prompt_workload_is_long_and_seeded(quick: bool) -> None:
    """`--workload long-prompt`: a few 1.5-3k-token prompts (where prefill attention dominates), the same for a
    seed, inside the vocabulary; the CLI takes the name for the engine bench and its breakdown."""
    from flashpage.bench.engine import make_workload
    from flashpage.cli import build_parser

    work = make_workload("long-prompt", 1000, quick=quick)
    assert len(work.prompts) == len(work.max_tokens) == (4 if quick else 8)
    assert all(1536 <= len(p) <= 3072 for p in work.prompts) and len({len(p) for p in work.prompts}) > 1
    assert all(0 <= t < 1000 for p in work.prompts for t in p) and work.shared_prefix == 0
    assert make_workload("long-prompt", 1000, quick=quick) == work
    for bench in ("engine", "breakdown"):
        assert build_parser().parse_args(["bench", bench, "--workload", "long-prompt"]).workload == "long-prompt"
    with pytest.raises(ValueError, match="long-prompt"):
        make_workload("longest", 1000)
