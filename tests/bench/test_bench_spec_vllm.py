"""`flashpage bench spec --against vllm`: option checks, and the side-by-side report with a fake vLLM runner (the
vLLM interpreter's results stood in for; flashpage runs for real on the built-in model): speedups, acceptance from
vLLM's counters, greedy agreement, and vLLM's own error where it refuses n-gram speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flashpage.bench import spec_vllm, vs_vllm
from flashpage.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REFUSAL = "ValueError: Speculative decoding is not supported on this platform (a stand-in for vLLM's message)"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_vllm_python_alone_is_refused(capsys, tmp_path: Path):
    code, _, err = _run(capsys, "bench", "spec", "--vllm-python", str(tmp_path / "python"), "--quick")
    assert code == 2 and "add --against vllm" in err


def test_missing_interpreter_and_draft_models_are_refused_before_any_model_loads(capsys, tmp_path: Path):
    code, _, err = _run(capsys, "bench", "spec", "--against", "vllm", "--quick")
    assert code == 2 and "--vllm-python PATH" in err
    missing = tmp_path / "venv" / "bin" / "python"
    code, _, err = _run(capsys, "bench", "spec", "--against", "vllm", "--vllm-python", str(missing), "--quick")
    assert code == 2 and f"--vllm-python {missing}: no such file" in err
    code, _, err = _run(capsys, "bench", "spec", "--against", "vllm", "--vllm-python", str(missing), "--quick",
                        "--speculative-config", '{"model": "flashpage-tiny", "num_speculative_tokens": 2}')
    assert code == 2 and "measures n-gram speculation" in err
    assert spec_vllm.vllm_spec_config({"num_speculative_tokens": 2, "prompt_lookup_max": 4}) == {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 4}


class FakeVLLM:
    """Stands in for ``run_vllm``: records each engine's spec; greedy cases get flashpage's own greedy tokens
    (``tokens``: case name -> ids) or ``wrong`` ones; the speculative engine reports its counters or fails."""

    def __init__(self, tokens: dict[str, list[list[int]]], refuse: bool = False, wrong: bool = False) -> None:
        self.tokens, self.refuse, self.wrong = tokens, refuse, wrong
        self.specs: list[dict[str, Any]] = []

    def __call__(self, python: str, spec: dict[str, Any], workdir: Path, timeout: float = 0.0) -> dict[str, Any]:
        self.specs.append(spec)
        speculative = spec["speculative_config"] is not None
        if speculative and self.refuse:
            raise vs_vllm.VLLMRunError(f"vLLM run failed (exit 1); the end of its log:\n{REFUSAL}")
        cases = []
        for case in spec["cases"]:
            ids = [[7] * case["max_tokens"]] * len(case["prompts"]) if self.wrong else self.tokens[case["name"]]
            counts = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 15} if speculative else {}
            cases.append({"name": case["name"], "tokens": ids, "output_tokens": sum(map(len, ids)),
                          "seconds": 0.5 if speculative else 1.0, "spec": counts})
        return {"cases": cases, "vllm_version": "0.32-test"}


def _flashpage_greedy(max_tokens: int) -> dict[str, list[list[int]]]:
    from flashpage import LLM, SamplingParams
    from flashpage.bench.spec import prompts_for
    from flashpage.tiny import load_tiny_model

    model, tok = load_tiny_model()
    outs = LLM(model, tok).generate(prompts_for("copy", 1, tok), SamplingParams(max_tokens=max_tokens,
                                    temperature=0, ignore_eos=True), use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    return {"copy-1": ids, "open-1": ids}


def test_side_by_side_report_with_a_fake_vllm(monkeypatch):
    fake = FakeVLLM(_flashpage_greedy(12))
    monkeypatch.setattr(vs_vllm, "check_vllm_python", lambda python: "0.32-test")
    monkeypatch.setattr(vs_vllm, "run_vllm", fake)
    result = spec_vllm.run_against_vllm("/fake/python", [1], 12, 1, NGRAM, repeats=1, rounds=2)
    assert [s["speculative_config"] for s in fake.specs] == [None, NGRAM, None, NGRAM]  # alternating rounds
    first = fake.specs[0]
    assert (first["block_size"], first["dtype"], first["threads"], first["max_model_len"]) == (128, "float32", 1, 512)
    assert Path(first["model"], "config.json").exists()  # the built-in model's saved checkpoint
    copy, open_ = result["rows"]
    assert (copy["workload"], copy["batch"], open_["workload"]) == ("copy", 1, "open")
    assert copy["vllm_speedup"] == 2.0 and copy["vllm_acceptance_length"] == 2.5  # 1 + 15 / 10
    assert copy["tokens_agree_with_vllm"] is True and copy["vllm_spec_identical"] is True
    assert copy["flashpage_spec_identical"] is True and open_["tokens_agree_with_vllm"] is None
    assert (copy["vllm_tok_s_base"], copy["vllm_tok_s_spec"]) == (12.0, 24.0)  # 12 tokens in 1.0 / 0.5 s
    assert copy["flashpage_over_vllm_base"] == pytest.approx(copy["flashpage_tok_s_base"] / 12.0, rel=0.01)
    assert copy["flashpage_speedup"] > 0 and result["vllm_spec_error"] is None
    report = spec_vllm.format_report(result)
    assert "2.00x" in report and "2.50" in report and "True/True/True" in report and "refused" not in report


def test_vllm_refusing_ngram_speculation_is_reported_with_its_error(monkeypatch):
    fake = FakeVLLM({}, refuse=True, wrong=True)
    monkeypatch.setattr(vs_vllm, "check_vllm_python", lambda python: "0.32-test")
    monkeypatch.setattr(vs_vllm, "run_vllm", fake)
    result = spec_vllm.run_against_vllm("/fake/python", [1], 8, 1, NGRAM, repeats=1, rounds=2)
    assert [s["speculative_config"] for s in fake.specs] == [None, NGRAM, None]  # not asked again after refusing
    assert REFUSAL in result["vllm_spec_error"]
    copy = result["rows"][0]
    assert copy["vllm_tok_s_base"] > 0 and copy["vllm_tok_s_spec"] is None and copy["vllm_speedup"] is None
    assert copy["tokens_agree_with_vllm"] is False
    report = spec_vllm.format_report(result)
    assert "vLLM refused n-gram speculation; its error:" in report and REFUSAL in report
