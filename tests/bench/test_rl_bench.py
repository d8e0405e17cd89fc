"""`flashpage bench rl`: its statistics (they can reject), and a miniature end-to-end run."""

from __future__ import annotations

import importlib.util
import random

import pytest

from flashpage.bench import rl
from flashpage.cli import build_parser

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                               reason="TRL not installed: pip install 'flashpage[rl]'")


def test_chi2_sf_known_values():
    assert rl.chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert rl.chi2_sf(18.307, 10) == pytest.approx(0.05, abs=1e-3)
    assert rl.chi2_sf(0.0, 3) == pytest.approx(1.0)


def test_homogeneity_and_ks_accept_equal_and_reject_different_distributions():
    rng = random.Random(0)
    same_a = rng.choices(range(6), weights=[5, 4, 3, 2, 1, 1], k=400)
    same_b = rng.choices(range(6), weights=[5, 4, 3, 2, 1, 1], k=400)
    other = rng.choices(range(6), weights=[1, 1, 2, 3, 4, 5], k=400)
    stat, dof = rl.chi2_homogeneity(same_a, same_b)
    assert rl.chi2_sf(stat, dof) > 1e-3
    stat, dof = rl.chi2_homogeneity(same_a, other)
    assert rl.chi2_sf(stat, dof) < 1e-6
    x = [rng.gauss(0, 1) for _ in range(300)]
    y = [rng.gauss(0, 1) for _ in range(300)]
    z = [rng.gauss(0.5, 1) for _ in range(300)]
    assert rl.ks_two_sample(x, y)[1] > 1e-3
    assert rl.ks_two_sample(x, z)[1] < 1e-4


def test_cli_has_bench_rl():
    args = build_parser().parse_args(["bench", "rl", "--quick", "--json"])
    assert args.bench == "rl" and args.quick


@needs_trl
def test_bench_rl_miniature_run():
    w = rl.RLWorkload(prompts=2, generations=3, max_new=6, repeats=1, test_rounds=1)
    result = rl.run(workload=w, systems=("flashpage", "flashpage_keep_kv", "trl_generate"))
    assert set(result["systems"]) == {"flashpage", "flashpage_keep_kv", "trl_generate"}
    for s in result["systems"].values():
        assert s["seconds_median"] > 0 and 0 < s["mean_completion_tokens"] <= 2 * 3 * 6
    assert result["distribution"]["samples"] == {"flashpage": 12, "trl_generate": 12}
    assert result["onpolicy"]["float32"]["rollout_vs_trainer"]["max_abs"] <= 1e-5
    assert "on-policy float32" in rl.format_report(result)
