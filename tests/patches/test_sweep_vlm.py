"""The image sweep (tests/sweep_vlm.py) over every image-text-to-text and multimodal-LM type of the installed
transformers (issue 36).

With image prompts, every type must come out exact (tokens and every step's logits within 1e-4 of unpatched
generate()), refused with ``UnsupportedModelError`` and its reason, or not buildable here (no image prompt or no
unpatched run, with the reason): no crash, no silent difference. A type that is exact must show that its images
change the unpatched output (else the comparison proves nothing about images). Where generate() is exact, the same
prompts through ``flashpage.LLM`` as image requests (each against unpatched generate() of that prompt alone) must be
exact or refused with the reason (``UnsupportedModelError``, or the engine's ``ValueError`` when the request is
added), never silent or a crash; every type of ``flashpage.engine.multimodal.IMAGE_TYPES`` exact in generate() must
be exact in LLM. docs/models.md's image matrix must be what this sweep measured (rewrite it with
``python tests/sweep_vlm.py --readme``; the JSON of a run goes where ``FLASHPAGE_SWEEP_VLM_JSON`` says).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import sweep_models as sm
import sweep_vlm as sv

from flashpage.engine.multimodal import IMAGE_TYPES

TIMEOUT = 90.0  # per type (the slowest, generate() and LLM, takes ~7 s alone; the machine may be loaded)
WORKERS = 2
# types exact with images when this sweep was written: losing one is a regression, not a new "not buildable"
EXACT_WITH_IMAGES = ("gemma3", "gemma4", "paligemma", "llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v",
                     "internvl", "idefics2", "idefics3", "smolvlm", "aya_vision", "llava_next", "mistral3",
                     "shieldgemma2", "got_ocr2", "deepseek_vl", "video_llava")


@pytest.fixture(scope="module")
def sweep() -> list[sv.VlmResult]:
    results = sv.run_sweep(sv.all_types(), workers=WORKERS, timeout=TIMEOUT)
    target = os.environ.get("FLASHPAGE_SWEEP_VLM_JSON")
    if target:
        Path(target).write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    return results


def test_every_type_exact_refused_or_unbuildable_with_images(sweep: list[sv.VlmResult]) -> None:
    assert [r.model_type for r in sweep] == sv.all_types()
    bad = [f"{r.model_type}: {r.outcome} ({r.image.detail})" for r in sweep if r.outcome not in sm.ALLOWED]
    assert not bad, "\n".join(bad)


def test_exact_types_compare_within_tolerance_and_images_matter(sweep: list[sv.VlmResult]) -> None:
    for r in sweep:
        if r.outcome == "exact":
            assert r.image.max_diff is not None and r.image.max_diff <= sm.LOGIT_ATOL, (r.model_type, r.image)
    by_type = {r.model_type: r for r in sweep}
    lost = [t for t in EXACT_WITH_IMAGES if by_type[t].outcome != "exact" or not by_type[t].effect]
    assert not lost, [(t, by_type[t].outcome, by_type[t].image.detail, by_type[t].effect) for t in lost]


def test_refusals_and_unbuildables_say_why(sweep: list[sv.VlmResult]) -> None:
    for r in sweep:
        if r.outcome == "refused":
            assert f"model_type='{r.model_type}" in r.image.detail, r.image.detail
        if r.outcome in ("refused", "unbuildable"):
            assert len(sm._reason(r.image)) > 20, (r.model_type, r.image.detail)


def test_llm_with_images_exact_refused_or_not_run(sweep: list[sv.VlmResult]) -> None:
    """LLM runs exactly where generate() is exact, and comes out exact or refused: never silent, never a crash."""
    bad = [f"{r.model_type}: {r.llm.outcome} ({r.llm.detail})" for r in sweep if r.llm.outcome not in sv.LLM_ALLOWED]
    assert not bad, "\n".join(bad)
    for r in sweep:
        assert (r.llm.outcome == "not-run") == (r.outcome != "exact"), (r.model_type, r.outcome, r.llm)
        if r.llm.outcome == "exact":
            assert r.llm.max_diff is not None and r.llm.max_diff <= sm.LOGIT_ATOL, (r.model_type, r.llm)


def test_image_types_exact_in_llm(sweep: list[sv.VlmResult]) -> None:
    """Every type LLM takes images for (engine/multimodal.py IMAGE_TYPES) whose generate() is exact here is exact
    in LLM too."""
    by_type = {r.model_type: r for r in sweep}
    lost = [(t, by_type[t].llm.outcome, by_type[t].llm.detail) for t in sorted(IMAGE_TYPES)
            if t in by_type and by_type[t].outcome == "exact" and by_type[t].llm.outcome != "exact"]
    assert not lost, lost


def test_llm_refusals_say_why(sweep: list[sv.VlmResult]) -> None:
    for r in sweep:
        if r.llm.outcome == "refused":
            assert len(sm._reason(r.llm)) > 20, (r.model_type, r.llm.detail)


def test_docs_matrix_is_this_sweep(sweep: list[sv.VlmResult]) -> None:
    current = sv.readme_section(sm.README.read_text())
    assert current == sv.readme_table(sweep), (
        "docs/models.md's image matrix is not what the sweep measured: run `python tests/sweep_vlm.py --readme`")


def test_runner_reports_a_hung_type_and_goes_on() -> None:
    """The causal-LM sweep's runner, driving this script's workers: a hung type is a crash row (timeout), the
    replaced worker sweeps the next type with an image."""
    results = sv.run_sweep(["__sleep__", "llava"], workers=1, timeout=30.0)
    assert [r.model_type for r in results] == ["__sleep__", "llava"]
    assert results[0].outcome == "crash" and "timeout" in results[0].image.detail
    assert results[1].outcome == "exact" and results[1].effect, results[1].to_json()
    assert results[1].llm.outcome == "exact", results[1].to_json()


def test_llm_refusal_is_a_refused_row_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LLM check in-process on LLaVA: exact; with llava taken out of IMAGE_TYPES, LLM's refusal when the image
    request is added is a ``refused`` result whose reason the matrix shows; the model is left unpatched."""
    from vlm_zoo import sweep_image_case

    import flashpage.engine.multimodal as mm
    from flashpage.patches import is_patched

    case = sweep_image_case("llava")
    notes: list[str] = []
    assert sv._llm_row(case.model, case.inputs, notes).outcome == "exact" and not notes
    monkeypatch.setattr(mm, "IMAGE_TYPES", mm.IMAGE_TYPES - {"llava"})
    refused = sv._llm_row(case.model, case.inputs, notes)
    assert refused.outcome == "refused" and "model_type='llava'" in refused.detail, refused
    assert not is_patched(case.model)
    row = sv.VlmResult("llava", sm.PathResult("exact", "", 0.0), refused, how=case.how, effect=True)
    assert sv.VlmResult.from_json(row.to_json()).to_json() == row.to_json()
    line = sv.readme_table([row]).splitlines()[-1]
    assert line.startswith("| llava | exact | refused |") and "LLM: images in LLM are verified exact" in line, line
