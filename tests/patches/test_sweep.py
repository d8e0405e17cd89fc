"""The causal-LM sweep (tests/sweep_models.py) over every type of the installed transformers.

Every type must come out exact, refused with ``UnsupportedModelError`` and its reason, or
unbuildable here (the unpatched model itself does not build or run): no crash, no silent
difference, in ``generate()`` and in ``LLM``. README's support matrix must be what this sweep
measured (rewrite it with ``python tests/sweep_models.py --readme``; the JSON of a run goes where
``FLASHPAGE_SWEEP_JSON`` says). The runner's own guarantees (a per-type timeout, a dead worker
replaced, results in input order) are tested on stand-in types that hang or kill their worker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import sweep_models as sm

TIMEOUT = 240.0  # per type (the slowest tiny model takes ~25 s alone; the machine may be loaded)
WORKERS = 2


@pytest.fixture(scope="module")
def sweep() -> list[sm.TypeResult]:
    results = sm.run_sweep(sm.all_types(), workers=WORKERS, timeout=TIMEOUT)
    target = os.environ.get("FLASHPAGE_SWEEP_JSON")
    if target:
        Path(target).write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    return results


def test_every_type_exact_refused_or_unbuildable(sweep: list[sm.TypeResult]) -> None:
    assert [r.model_type for r in sweep] == sm.all_types()
    bad = [f"{r.model_type}: generate {r.generate.outcome} ({r.generate.detail}); LLM {r.llm.outcome} "
           f"({r.llm.detail})" for r in sweep if r.outcome not in sm.ALLOWED]
    assert not bad, "\n".join(bad)


def test_refusals_name_type_and_reason(sweep: list[sm.TypeResult]) -> None:
    for r in sweep:
        for path in (r.generate, r.llm):
            if path.outcome == "refused":
                # the built model's own type (MllamaForCausalLM's config is mllama_text_model)
                assert f"model_type='{r.model_type}" in path.detail, path.detail
                assert len(sm._reason(path)) > 20, path.detail


def test_exact_means_within_tolerance(sweep: list[sm.TypeResult]) -> None:
    for r in sweep:
        for path in (r.generate, r.llm):
            if path.outcome == "exact":
                assert path.max_diff is not None and path.max_diff <= sm.LOGIT_ATOL, (r.model_type, path)


def test_supported_families_stay_exact(sweep: list[sm.TypeResult]) -> None:
    """The families README promised before the sweep existed stay exact in generate()."""
    from model_zoo import FAMILIES

    by_type = {r.model_type: r for r in sweep}
    lost = [t for t in FAMILIES if t in by_type and by_type[t].generate.outcome != "exact"]
    assert not lost, lost


def test_readme_matrix_is_this_sweep(sweep: list[sm.TypeResult]) -> None:
    current = sm.readme_section(sm.README.read_text())
    assert current == sm.readme_table(sweep), (
        "README's support matrix is not what the sweep measured: run `python tests/sweep_models.py --readme`")


def test_runner_timeout_dead_worker_and_order() -> None:
    results = sm.run_sweep(["__sleep__", "__exit__", "llama"], workers=2, timeout=45.0)
    assert [r.model_type for r in results] == ["__sleep__", "__exit__", "llama"]
    assert results[0].outcome == "crash" and "timeout" in results[0].generate.detail
    assert results[1].outcome == "crash" and "worker died" in results[1].generate.detail
    assert results[2].outcome == "exact", results[2]  # the replaced worker goes on with the next type
