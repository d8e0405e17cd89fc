"""`flashpage bench spec --model-shape`: the early-exit draft (the target's first layers + its final norm and
head) and n-gram against no speculation, with the shape loader stood in for by the built-in model (building a
real shape is test_bench_shapes.py's); and its options refused before any model is built."""

from __future__ import annotations

from typing import Any

import pytest

from flashpage.bench import spec_shape
from flashpage.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


def _tiny_pair(name: str, dtype: str, num_layers: int, draft_layers: int) -> tuple[Any, Any, Any, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from flashpage import tiny_model_path
    from flashpage.tiny import load_tiny_model

    target, tok = load_tiny_model()
    draft = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), num_hidden_layers=draft_layers).eval()
    assert draft.config.num_hidden_layers == draft_layers < target.config.num_hidden_layers
    info = {"name": name, "source": "test", "model_type": "llama", "layers": target.config.num_hidden_layers,
            "published_layers": num_layers, "dtype": dtype, "parameters": 1, "draft_layers": draft_layers,
            "draft_parameters": sum(p.numel() for p in draft.parameters())}
    return target, draft, tok, info


def test_shape_bench_runs_both_methods(monkeypatch):
    monkeypatch.setattr(spec_shape, "load_pair", _tiny_pair)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    result = spec_shape.run_shape("qwen3-0.6b", "float32", 8, 1, [1], 12, 1, spec, repeats=1)
    rows = result["rows"]
    assert [(r["method"], r["workload"]) for r in rows] == [("ngram", "copy"), ("ngram", "open"),
                                                            ("draft", "copy"), ("draft", "open")]
    assert all(r["identical"] is True for r in rows if r["workload"] == "copy")  # float32: greedy identical
    assert all(r["tokens_per_s_base"] > 0 and r["tokens_per_s_spec"] > 0 for r in rows)
    assert result["speculative_configs"]["draft"] == {"model": "first 1 layers of the target",
                                                     "num_speculative_tokens": 3}
    report = spec_shape.format_report(result)
    assert "draft: its first 1 layers + final norm + LM head" in report and "draft  copy" in report


@pytest.mark.parametrize("argv, message", [
    (("--num-layers", "2", "--draft-layers", "2"), "--draft-layers 2: give 1 to 1"),
    (("--speculative-config", '{"model": "flashpage-tiny", "num_speculative_tokens": 2}'), "is the n-gram one"),
])
def test_bad_shape_options_are_refused(capsys, monkeypatch, argv, message):
    monkeypatch.setattr("flashpage.bench.shapes.load_shape_bench_model",
                        lambda *a, **k: pytest.fail("a model was loaded"))
    code = main(["bench", "spec", "--model-shape", "qwen3-0.6b", *argv])
    assert code == 2 and message in capsys.readouterr().err
