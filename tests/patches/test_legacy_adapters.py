"""The adapters of patches/legacy.py: models whose attention bypasses transformers' interface
(GPT-Neo with a local window, GPT-NeoX-Japanese, BLOOM and MPT with ALiBi, Falcon rotary / ALiBi /
grouped-query; the BART-like XGLM, TrOCR, MVP; the BERT-like Megatron-BERT, RemBERT, RoFormer with its
rotary embedding, BigBird) run attention on the pages, exactly.

For each variant (tiny random float32 models from the sweep's configs):
- patched ``generate()`` on a left-padded batch equals unpatched ``generate()`` (tokens, logits within
  1e-4), and the attention ran on the pages (the paged forward was called for every layer);
- ``flashpage.LLM`` (chunked prompts packed with decodes, prefix caching hitting a shared prefix, a
  pool small enough to preempt) equals unpatched ``generate()`` of each prompt alone, chosen-token
  logprobs within 1e-4;
- the module's own forward runs where the pages cannot say what it computes (right padding under
  ALiBi / a window, attention weights asked for): same logits and weights as unpatched;
- training is untouched: the patched model's training forward (no cache, dropout on) gives exactly
  the unpatched loss and gradients, and ``unpatch`` removes every change.
Configurations an adapter cannot run exactly are refused up front (a BERT-like model that is not a
decoder attends bidirectionally; BigBird's block-sparse attention; MVP's prompt prefixes), and so are
types no adapter can make exact, each with its own reason (CPM-Ant, XLM, OpenAI-GPT, ...).
The ALiBi option of the layer kernels is checked against the reference flash-attn kernel.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_helpers import hf_greedy, random_prompts
from model_zoo import left_padded_batch
from sweep_configs import sweep_config
from transformers import AutoModelForCausalLM, DynamicCache

import flashpage
from flashpage import LLM, SamplingParams
from flashpage.kernels import flash_attn_with_kvcache
from flashpage.kernels.paged import LayerOptions, attend_static
from flashpage.patches import legacy
from flashpage.patches.hf_cache import HFPagedCache
from flashpage.patches.patching import patch_state
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

VOCAB = 128
MAX_NEW = 10
TOL = 1e-4
# variant -> (model_type, config overrides); windows and ALiBi small enough to matter in these lengths
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_neo-local": ("gpt_neo", {"window_size": 4}),
    "gpt_neox_japanese": ("gpt_neox_japanese", {}),
    "bloom": ("bloom", {}),
    "mpt": ("mpt", {}),
    "falcon-rotary-mqa": ("falcon", {"multi_query": True, "new_decoder_architecture": False, "alibi": False}),
    "falcon-alibi": ("falcon", {"multi_query": False, "new_decoder_architecture": False, "alibi": True,
                                "num_kv_heads": 4}),
    "falcon-gqa": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "alibi": False}),
    "xglm": ("xglm", {}),
    "trocr": ("trocr", {}),
    "mvp": ("mvp", {}),
    "megatron-bert": ("megatron-bert", {"is_decoder": True}),
    "rembert": ("rembert", {"is_decoder": True}),
    "roformer": ("roformer", {"is_decoder": True}),
    "big_bird": ("big_bird", {"is_decoder": True, "attention_type": "original_full"}),
}
# transformers 5.24's MPT generate() hands its model no cache (every step recomputes the whole
# sequence, patched or not): nothing to page there; flashpage.LLM passes the cache and pages it.
NO_CACHE_IN_GENERATE = {"mpt"}


def build(variant: str, seed: int = 0, **extra: Any) -> torch.nn.Module:
    model_type, overrides = VARIANTS[variant]
    config = sweep_config(model_type)
    for key, value in {"vocab_size": VOCAB, **overrides, **extra}.items():
        setattr(config, key, value)
    if model_type == "mpt":
        assert config.attn_config.alibi  # the variant is an ALiBi model
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # decisive logits (random init is near-uniform)
        for name, p in model.named_parameters():
            if p.dim() == 2 and ("lm_head" in name or "embed" in name or "wte" in name or "word_embeddings" in name):
                p.mul_(4.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def _model(models: dict[str, torch.nn.Module], variant: str) -> torch.nn.Module:
    if variant not in models:
        models[variant] = build(variant)
    flashpage.unpatch(models[variant])
    return models[variant]


@pytest.fixture
def paged_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Layer indices the paged forward ran for (a spy on legacy.paged_forward)."""
    calls: list[int] = []
    original = legacy.paged_forward

    def spy(module, cache, spec, arguments):
        calls.append(spec.layer(module))
        return original(module, cache, spec, arguments)

    monkeypatch.setattr(legacy, "paged_forward", spy)
    return calls


def _greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], list(out.logits)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generate_on_the_pages_equals_unpatched(models, variant: str, paged_calls: list[int]) -> None:
    model = _model(models, variant)
    ids, mask = left_padded_batch([7, 3, 11], seed=3)
    ids = ids.clamp(max=VOCAB - 1)
    ref_tokens, ref_logits = _greedy(model, ids, mask)
    flashpage.patch(model)
    assert patch_state(model).family.path == "adapter"
    paged_calls.clear()  # patch()'s probe forwards
    got_tokens, got_logits = _greedy(model, ids, mask)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if variant not in NO_CACHE_IN_GENERATE:
        assert sorted(set(paged_calls)) == list(range(layers))  # every layer attended on the pages
        assert len(paged_calls) == layers * MAX_NEW  # every forward of generate() did
    for row in range(ids.shape[0]):
        match = compare_greedy(ref_tokens[row].tolist(), got_tokens[row].tolist(), [s[row] for s in ref_logits])
        assert match.ok, f"row {row}: {match.explain()}"
        upto = match.position if match.position is not None else MAX_NEW
        for step in range(upto):
            diff = (ref_logits[step][row] - got_logits[step][row]).abs().max().item()
            assert diff <= TOL, f"row {row} step {step}: logits differ by {diff:.3g}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llm_packed_prefix_cached_preempted_equals_unpatched(models, variant: str, paged_calls: list[int]) -> None:
    model = _model(models, variant)
    prompts = random_prompts(3, 3, 9, seed=4, prefix=random_prompts(1, 9, 9, seed=5)[0]) + random_prompts(2, 2, 6)
    llm = LLM(model, block_size=4, num_blocks=14, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=True, check_invariants=True)
    state = patch_state(model)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert patch_state(model) is state  # the engine kept the patch (no re-patch per step)
    stats = llm.stats()
    assert paged_calls
    assert stats.preemptions > 0 and stats.prefix_cache_hit_rate > 0
    for prompt, out in zip(prompts, (o.outputs[0] for o in outs), strict=True):
        ref, logits = hf_greedy(model, prompt, MAX_NEW, eos=False)
        match = compare_greedy(ref, out.token_ids, logits)
        assert match.ok, f"prompt of {len(prompt)}: {match.explain()}"
        upto = match.position if match.position is not None else len(out.token_ids)
        for step in range(upto):
            expected = torch.log_softmax(logits[step].float(), dim=-1)[ref[step]].item()
            assert math.isclose(out.logprobs[step].logprob, expected, abs_tol=TOL), f"step {step}"


@pytest.mark.parametrize("variant", ["gpt_neo-local", "bloom", "mpt", "falcon-alibi"])
def test_own_forward_where_pages_cannot_say(models, variant: str, paged_calls: list[int]) -> None:
    """Right padding under ALiBi / a window, and attention weights: the module's own forward on K/V
    read back from the pages, exactly the unpatched result."""
    model = _model(models, variant)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding: a hole before the next token
    step_ids = torch.randint(3, VOCAB, (2, 1), generator=torch.Generator().manual_seed(7))
    step_mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)

    def run(cache: Any) -> list[Any]:
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                          output_attentions=True)
            second = model(input_ids=step_ids, attention_mask=step_mask, past_key_values=cache, use_cache=True)
        return [first.logits, second.logits, first.attentions[-1]]

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # weights come from eager attention (Falcon's sdpa returns none from 5.25)
    try:
        expected = run(DynamicCache(config=model.config))
        assert expected[2] is not None, "the unpatched model returned no attention weights"
        flashpage.patch(model)
        paged_calls.clear()  # patch()'s probe forwards
        got = run(HFPagedCache(model.config, block_size=4, num_blocks=16))
    finally:
        flashpage.unpatch(model)
        model.set_attn_implementation(previous)
    # prefill: the module's own forward (weights asked for); decode: a hole under ALiBi / a window needs it too,
    # while GPT-Neo's global layer 0 (no window) attends on the pages
    assert paged_calls == ([0] if variant == "gpt_neo-local" else [])
    keep = torch.cat([mask, torch.ones_like(step_ids)], dim=1)[:, None, -1:]  # decode logits: both rows real
    for name, a, b in zip(("prefill logits", "decode logits", "attention weights"), expected, got, strict=True):
        if name == "prefill logits":
            a, b = a[mask.bool()], b[mask.bool()]
        assert b is not None and (a - b).abs().max().item() <= TOL, name
    assert keep.all()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_training_forward_untouched_and_unpatch_restores(variant: str) -> None:
    def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, mask = left_padded_batch([9, 6], seed=5)
        ids = ids.clamp(max=VOCAB - 1)
        model.zero_grad(set_to_none=True)
        model.train()
        torch.manual_seed(1234)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    config = VARIANTS[variant][1]
    dropouts = {k: 0.1 for k, v in sweep_config(VARIANTS[variant][0]).to_dict().items()
                if isinstance(v, float) and ("dropout" in k or "pdrop" in k) and k != "classifier_dropout"}
    model = build(variant, **dropouts, **config)
    loss_a, grads_a = loss_and_grads(model)
    flashpage.patch(model)
    adapted = [m for m in model.modules() if "forward" in vars(m)]
    assert adapted  # the attention modules got the paged forward
    loss_b, grads_b = loss_and_grads(model)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    flashpage.unpatch(model)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("causal_rows", [(5, 5), (3, 9), (1, 7)])
def test_alibi_layer_kernel_matches_reference(causal_rows: tuple[int, int]) -> None:
    """attend_static with ALiBi slopes == reference flash_attn_with_kvcache(alibi_slopes=...)."""
    sq, sk = causal_rows
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, d, block = 4, 2, 8, 4
    blocks = -(-sk // block)
    k_pages = torch.randn(blocks * 2 + 1, block, kv_heads, d, generator=g)
    v_pages = torch.randn(blocks * 2 + 1, block, kv_heads, d, generator=g)
    table = torch.stack([torch.arange(1, 1 + blocks), torch.arange(1 + blocks, 1 + 2 * blocks)]).to(torch.int32)
    seqlens = torch.tensor([sk, sk - 1], dtype=torch.int32)
    q = torch.randn(2, sq, heads, d, generator=g)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    opts = LayerOptions(0.3, True, (-1, -1), 0.0, slopes)
    got = attend_static(q.transpose(1, 2), k_pages, v_pages, table, seqlens, opts).transpose(1, 2)
    want = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                             softmax_scale=0.3, causal=True, alibi_slopes=slopes)
    plain = attend_static(q.transpose(1, 2), k_pages, v_pages, table, seqlens,
                          LayerOptions(0.3, True)).transpose(1, 2)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # the bias changes the result


@pytest.mark.parametrize(("variant", "extra", "reason"), [
    ("megatron-bert", {"is_decoder": False}, "is_decoder=False"),
    ("big_bird", {"attention_type": "block_sparse"}, "block-sparse"),
    ("mvp", {"use_prompt": True}, "prompt key/value prefixes"),
])
def test_configurations_the_adapter_cannot_run_are_refused(variant: str, extra: dict[str, Any], reason: str) -> None:
    model = build(variant, **extra)
    with pytest.raises(flashpage.UnsupportedModelError, match=reason):
        flashpage.patch(model)
    assert not flashpage.is_patched(model) and not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize(("model_type", "reason"), [
    ("cpmant", "relative-position bias"),
    ("xlm", "cache.get_seq_length"),
    ("openai-gpt", "keeps no K/V cache"),
])
def test_types_no_adapter_can_make_exact_say_why(model_type: str, reason: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(sweep_config(model_type), dtype=torch.float32).eval()
    with pytest.raises(flashpage.UnsupportedModelError, match=reason) as info:
        flashpage.patch(model)
    assert f"model_type={model.config.model_type!r}" in str(info.value)
    assert not flashpage.is_patched(model)


def test_composite_model_whose_vision_part_bypasses_the_interface() -> None:
    """GOT-OCR2: its vision encoder cannot select an attention implementation, its text model can:
    flashpage's attention is selected for the text model only, exact, and unpatch restores it."""
    torch.manual_seed(0)
    config = sweep_config("got_ocr2")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    text, vision = config.get_text_config(decoder=True), config.vision_config
    before = (text._attn_implementation, vision._attn_implementation)
    ids, mask = left_padded_batch([7, 4], seed=9)
    ids = ids.clamp(min=3, max=min(VOCAB, text.vocab_size) - 1).masked_fill(mask == 0, 0)
    ref_tokens, ref_logits = _greedy(model, ids, mask)
    flashpage.patch(model)
    assert patch_state(model).family.path == "interface"
    assert (text._attn_implementation, vision._attn_implementation) == ("pagedkv", before[1])
    got_tokens, got_logits = _greedy(model, ids, mask)
    assert torch.equal(ref_tokens, got_tokens)
    assert max((a - b).abs().max().item() for a, b in zip(ref_logits, got_logits, strict=True)) <= TOL
    flashpage.unpatch(model)
    assert (text._attn_implementation, vision._attn_implementation) == before
