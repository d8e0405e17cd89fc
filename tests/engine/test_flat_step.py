"""The flat eager step (flashpage/engine/flat.py): for plain Llama-family decoders the engine's eager steps
run as one loop over the layers, verified bit for bit against the model's forward on a step first. Tokens
equal transformers', logprobs equal the module forward's exactly (``FLASHPAGE_FLAT=0``), sliding windows and
per-head norms are those the model's forward passes, and a loop that differs, raises, or meets a forward hook
never decides a token."""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_helpers import hf_greedy, random_prompts
from model_zoo import tiny_model

from flashpage import LLM, SamplingParams
from flashpage.engine import flat
from flashpage.patches import unpatch
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
# qwen2: q/k/v biases and a sliding layer; mistral: the window from its config; qwen3: per-head q/k norms
FAMILIES = {"llama": {}, "mistral": {},
            "qwen2": {"use_sliding_window": True, "sliding_window": 8,
                      "layer_types": ["full_attention", "sliding_attention"]},
            "qwen3": {}}


def _run(model: torch.nn.Module, prompts: list[list[int]], monkeypatch, on: bool = True, **kw):
    """(LLM, outputs) of a fresh engine with the flat step on or off; the model is unpatched after."""
    monkeypatch.setenv(flat.ENV, "1" if on else "0")
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=64, **kw)
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    finally:
        unpatch(model)
    return llm, outs


def _logprobs(outs) -> list[list[float]]:
    return [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_flat_steps_equal_the_module_forward_and_transformers(model_type, monkeypatch):
    model = tiny_model(model_type, max_position_embeddings=512, **FAMILIES[model_type])
    prompts = random_prompts(3, 12, 40, seed=4)  # longer than the windows: they must be the model's own
    llm, outs = _run(model, prompts, monkeypatch)
    assert llm.flat_step.startswith("on: verified"), llm.flat_step
    stats = llm.stats()
    assert 0 < stats.flat_steps < stats.steps, "all but the packing probe and the verifying step ran flat"
    off, outs_off = _run(model, prompts, monkeypatch, on=False)
    assert off.stats().flat_steps == 0 and off.flat_step == f"off: {flat.ENV}=0"
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in outs_off]
    assert _logprobs(outs) == _logprobs(outs_off), "bit for bit the module forward's logits"
    for prompt, out in zip(prompts, outs, strict=True):
        ref, logits = hf_greedy(model, prompt, PARAMS.max_tokens, eos=False)
        match = compare_greedy(ref, out.outputs[0].token_ids, logits)
        assert match.ok, f"{model_type}: {match.explain()}"


def test_window_and_geometry_come_from_the_model_forward(monkeypatch):
    model = tiny_model("qwen2", max_position_embeddings=512, **FAMILIES["qwen2"])
    llm, _ = _run(model, random_prompts(2, 12, 20, seed=1), monkeypatch)
    windows = [o.window_size for o in llm._flat.options]
    assert windows == [(-1, -1), (7, 0)], "layer 0 full, layer 1 a window of 8 keys (the model's layer types)"
    assert all(o.softmax_scale == model.model.layers[0].self_attn.scaling for o in llm._flat.options)


@pytest.mark.parametrize("model_type", ["gemma", "gpt2", "phi3"])
def test_other_families_keep_the_module_forward(model_type, monkeypatch):
    model = tiny_model(model_type, max_position_embeddings=512) if model_type != "gpt2" else tiny_model("gpt2")
    llm, _ = _run(model, random_prompts(2, 5, 10, seed=2), monkeypatch)
    assert llm._flat is None and llm.stats().flat_steps == 0
    assert llm.flat_step.startswith("off: model type"), llm.flat_step


def test_a_subclassed_module_keeps_the_module_forward(monkeypatch):
    model = tiny_model("llama", max_position_embeddings=512)

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 1.5

    old = model.model.layers[1].self_attn.o_proj
    new = Scaled(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    model.model.layers[1].self_attn.o_proj = new
    prompts = random_prompts(2, 5, 12, seed=5)
    llm, outs = _run(model, prompts, monkeypatch)
    assert llm._flat is None and "model.layers.1.self_attn.o_proj is Scaled" in llm.flat_step, llm.flat_step
    ref, logits = hf_greedy(model, prompts[0], PARAMS.max_tokens, eos=False)
    assert compare_greedy(ref, outs[0].outputs[0].token_ids, logits).ok


def test_a_loop_that_differs_is_refused_and_its_kv_rewritten(monkeypatch):
    """A loop whose K/V (so logits) differ fails the verification: a warning says so, the module forward's K/V
    are stored again, and every token and logprob is the module forward's."""
    model = tiny_model("llama", max_position_embeddings=512)
    prompts = random_prompts(3, 12, 30, seed=6)
    _, want = _run(model, prompts, monkeypatch, on=False)
    real = flat.flat_decoder

    def skewed(m):
        decoder = real(m)
        layer = decoder.layers[0]
        k = layer.k
        decoder.layers[0] = flat.FlatLayer(**{**vars(layer), "k": lambda x: k(x) * 1.01})
        return decoder

    monkeypatch.setattr("flashpage.engine.runner.flat_decoder", skewed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm, outs = _run(model, prompts, monkeypatch)
    assert llm.flat_step.startswith("off: flat step differs"), llm.flat_step
    assert any("flat eager step" in str(w.message) for w in caught)
    assert llm.stats().flat_steps == 0
    assert _logprobs(outs) == _logprobs(want), "no K/V of the skewed loop survived"


def test_a_loop_that_raises_is_refused(monkeypatch):
    model = tiny_model("llama", max_position_embeddings=512)
    prompts = random_prompts(2, 8, 20, seed=7)
    _, want = _run(model, prompts, monkeypatch, on=False)

    def broken(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(flat.FlatDecoder, "forward", broken)
    with pytest.warns(UserWarning, match="flat step raised RuntimeError: boom"):
        llm, outs = _run(model, prompts, monkeypatch)
    assert _logprobs(outs) == _logprobs(want)


def test_a_hook_added_later_runs_and_the_step_falls_back(monkeypatch):
    monkeypatch.setenv(flat.ENV, "1")
    model = tiny_model("llama", max_position_embeddings=512)
    llm = LLM(model, max_num_seqs=4)
    try:
        llm.generate(random_prompts(2, 8, 16, seed=8), PARAMS, use_tqdm=False)
        before = llm.stats().flat_steps
        assert before > 0
        calls = []
        handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: calls.append(1))
        llm.generate(random_prompts(1, 8, 16, seed=9), PARAMS, use_tqdm=False)
        assert calls and llm.stats().flat_steps == before, "the hook ran: the module forward did"
        handle.remove()
        llm.generate(random_prompts(1, 8, 16, seed=9), PARAMS, use_tqdm=False)
        assert llm.stats().flat_steps > before, "without the hook the verified loop runs again"
    finally:
        unpatch(model)


def test_weight_changes_keep_or_rebuild_the_loop(monkeypatch):
    """In-place weight updates (an optimizer step) keep the verified loop; a replaced module is a new
    structure: the loop is rebuilt and verified again, and tokens follow the new weights."""
    monkeypatch.setenv(flat.ENV, "1")
    model = tiny_model("llama", max_position_embeddings=512)
    prompts = random_prompts(2, 8, 16, seed=10)
    llm = LLM(model, max_num_seqs=4)
    try:
        llm.generate(prompts, PARAMS, use_tqdm=False)
        first = llm._flat
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.mul_(1.1)
        llm.generate(prompts, PARAMS, use_tqdm=False)
        assert llm._flat is first and llm.weights_version == 1
        old = model.model.layers[0].self_attn.o_proj  # (the MLP's linears are called by the MLP's forward)
        new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
        with torch.no_grad():
            new.weight.copy_(old.weight * 0.5)
        model.model.layers[0].self_attn.o_proj = new
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert llm._flat is not first and llm._flat.verified and llm.weights_version == 2
    finally:
        unpatch(model)
    for prompt, out in zip(prompts, outs, strict=True):
        ref, logits = hf_greedy(model, prompt, PARAMS.max_tokens, eos=False)
        assert compare_greedy(ref, out.outputs[0].token_ids, logits).ok


def test_info_says_whether_the_flat_step_is_on(monkeypatch):
    from flashpage.info import collect_info, format_info

    monkeypatch.setenv(flat.ENV, "1")
    assert "LLM flat eager step: one flat loop over the layers for llama, mistral" in format_info(collect_info())
    monkeypatch.setenv(flat.ENV, "0")
    assert collect_info()["cpu_threads"]["flat_step"] == "off (FLASHPAGE_FLAT=0): the model's forward"
