"""The real-shape model zoo (flashpage/bench/shapes.py) and its CLI.

Every registry entry's config is checked on the ``meta`` device only (Gemma-3-1B's 262k x 1152 embedding
alone is 0.6 GB in bfloat16): it builds with the installed transformers and its full-size parameter count
is the published one. Only Qwen3-0.6B is built for real, with 1 of its 28 layers (171M parameters: 0.7 GB
in float32, 0.34 GB in bfloat16): greedy decoding has real margins, bfloat16 is float32's weights rounded,
and ``saved_shape`` round-trips through ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flashpage import tiny_model_path
from flashpage.bench import shapes
from flashpage.cli import main

NAME = "qwen3-0.6b"


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_published_config_builds_and_counts_as_published(name: str) -> None:
    shape = shapes.SHAPES[name]
    config = shapes.shape_config(name, full=True)
    assert config.model_type == shape.model_type
    assert config.num_hidden_layers == shape.config["num_hidden_layers"]
    params = shapes.count_parameters(config)
    assert abs(params - shape.published_params) / shape.published_params < 0.05, (name, params)


def test_registry_details() -> None:
    llama = shapes.shape_config("llama-3.2-1b")
    rope = llama.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0 and rope["rope_theta"] == 500_000.0
    gemma = shapes.shape_config("gemma-3-1b", num_layers=8)
    assert gemma.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert gemma.sliding_window == 512 and gemma.num_key_value_heads == 1 and gemma.head_dim == 256
    moe = shapes.shape_config("qwen3-30b-a3b-4l16e")
    assert (moe.num_hidden_layers, moe.num_experts, moe.num_experts_per_tok) == (4, 16, 8)
    assert shapes.shape_config("qwen3-30b-a3b-4l16e", full=True).num_experts == 128
    with pytest.raises(ValueError, match="unknown model shape"):
        shapes.get_shape("qwen3-7b")
    with pytest.raises(ValueError, match="at least 1"):
        shapes.shape_config(NAME, num_layers=0)


@pytest.fixture(scope="module")
def qwen_fp32() -> Any:
    return shapes.build_shape(NAME, torch.float32, num_layers=1)


def test_greedy_has_real_margins(qwen_fp32: Any) -> None:
    gaps: list[float] = []
    distinct: list[int] = []
    for seed in range(2):
        ids = torch.randint(3, 4096, (1, 16), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = qwen_fp32.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                     eos_token_id=None)
        for logits in out.logits:
            top = logits[0].topk(2).values
            gaps.append(float(top[0] - top[1]))
        distinct.append(len(set(out.sequences[0, 16:].tolist())))
    gaps.sort()
    assert gaps[len(gaps) // 2] > 0.1, gaps  # median
    assert min(distinct) > 2, distinct  # not a copy of the last token forever


def test_bfloat16_is_float32_rounded(qwen_fp32: Any) -> None:
    bf16 = shapes.build_shape(NAME, torch.bfloat16, num_layers=1)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    ours = dict(bf16.named_parameters())
    for key, param in qwen_fp32.named_parameters():
        assert torch.equal(ours[key], param.to(torch.bfloat16)), key


def test_saved_shape_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv(shapes.CACHE_ENV, str(tmp_path))
    path = shapes.saved_shape(NAME, "bfloat16", num_layers=1)
    assert path == tmp_path / f"{NAME}-bfloat16-1l"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # the temporary folder was renamed
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert len(tokenizer) == 151936  # every id the model can generate decodes to text
    tiny = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    text = "The list module returns a new value, h\u00e9llo w\u00f6rld 123!"
    assert tokenizer(text).input_ids == tiny(text).input_ids  # encoding unchanged
    words = [tokenizer.decode([i]) for i in (4096, 100000, 151935)]
    assert all(w.startswith(" ") and w[1:].isalpha() for w in words) and len(set(words)) == 3
    loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    built = shapes.build_shape(NAME, torch.bfloat16, num_layers=1)
    ids = torch.randint(3, 4096, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, built(ids).logits)

    def no_rebuild(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("saved_shape rebuilt a saved shape")

    monkeypatch.setattr(shapes, "build_shape", no_rebuild)
    assert shapes.saved_shape(NAME, torch.bfloat16, num_layers=1) == path
    tiny.save_pretrained(str(path))  # a folder cached before the vocabulary was filled: updated in place
    assert len(AutoTokenizer.from_pretrained(str(path))) == 4096
    assert shapes.saved_shape(NAME, torch.bfloat16, num_layers=1) == path
    assert len(AutoTokenizer.from_pretrained(str(path))) == 151936
    info = shapes.describe(NAME, "bfloat16", 1)
    assert info["parameters"] == sum(p.numel() for p in loaded.parameters())
    assert shapes.header_line(info).startswith(f"shape: {NAME} (Qwen/Qwen3-0.6B config, qwen3, random weights), "
                                               "1 of 28 layers, bfloat16, 171.3M params")


def test_cli_lists_the_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "shapes"]) == 0
    out = capsys.readouterr().out
    for name in shapes.SHAPES:
        assert name in out
    assert main(["bench", "shapes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(shapes.SHAPES)
    moe = rows[-1]
    assert (moe["layers"], moe["published_layers"]) == (4, 48) and moe["bytes_bf16"] == 2 * moe["parameters"]


@pytest.mark.parametrize("bench", ["engine", "generate"])
@pytest.mark.parametrize("argv, message", [
    (["--dtype", "bfloat16"], "--dtype is for --model-shape"),
    (["--num-layers", "2"], "--num-layers is for --model-shape"),
    (["--model", "x", "--model-shape", NAME], "give one"),
])
def test_shape_flags_are_checked_before_loading(capsys: pytest.CaptureFixture[str], bench: str, argv: list[str],
                                                message: str) -> None:
    assert main(["bench", bench, "--quick", *argv]) == 2
    assert message in capsys.readouterr().err


def test_generate_bench_holds_half_precision_to_its_kv_bound_not_to_tokens() -> None:
    """bench generate's exit status: float32 needs equal tokens; bfloat16 reports them (no token contract) but
    still needs the paged KV within its bound."""
    from flashpage.bench.runner import _ok

    differ = {"outputs_agree": False, "kv_within_bound": True}
    assert not _ok("generate", {**differ, "token_contract": True})
    assert _ok("generate", {**differ, "token_contract": False})
    assert not _ok("generate", {**differ, "token_contract": False, "kv_within_bound": False})


def test_engine_refuses_an_unknown_shape(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "engine", "--model-shape", "qwen3-7b"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_half_precision_ties_are_rounding_steps() -> None:
    """A bfloat16 difference at a gap of one rounding step is a tie; a float32 one at that gap is not."""
    import torch

    from flashpage.testing import TIE_TOL, compare_greedy, tie_tol

    row = torch.zeros(16)
    row[3], row[5] = 8.0, 8.0 - 0.0625  # one bfloat16 step below 8
    assert tie_tol(torch.float32, row) == TIE_TOL
    assert tie_tol(torch.bfloat16, row) == 0.125 and tie_tol(torch.float16, row) == 2 * 8 * 2.0 ** -10
    assert compare_greedy([3], [5], [row], dtype=torch.bfloat16).ok
    assert not compare_greedy([3], [5], [row]).ok and not compare_greedy([3], [5], [row], dtype=torch.float32).ok
    row[5] = 8.0 - 0.5  # eight steps: a real difference in bfloat16 too
    assert not compare_greedy([3], [5], [row], dtype=torch.bfloat16).ok
