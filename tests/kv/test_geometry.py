"""Per-layer K/V geometry: page pools per geometry group sharing one block table, and layers that
read another layer's K/V (Gemma 3n / Gemma 4 KV sharing).

The cache-level tests check the pools directly; the model tests check patched ``generate()`` and
``LLM`` against unpatched ``generate()`` (tokens, and logits / logprobs within 1e-4) on tiny
random models whose layers differ in KV heads and head sizes (Gemma 4's sliding vs global layers,
MiMo-V2-Flash) or reuse another layer's K/V (Gemma 3n, Gemma 4 ``num_kv_shared_layers``).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from model_zoo import PAD, left_padded_batch, model_from_config, torch_threads
from transformers import AutoConfig

import flashpage
from flashpage import LayerGeometry, PagedKVCache, SamplingParams
from flashpage.patches import is_patched, unpatch
from flashpage.testing import compare_greedy

MAX_NEW = 8
_BASE = dict(vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
             hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=256)
_FOUR = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# model type, config overrides, what the test shows
CASES: dict[str, tuple[str, dict]] = {
    # global layers: 1 KV head of 32 (K = V), sliding layers: 2 KV heads of 16
    "gemma4-mixed": ("gemma4_text", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                                         num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=4,
                                         layer_types=_FOUR, hidden_size_per_layer_input=16,
                                         vocab_size_per_layer_input=128)),
    # mixed head sizes and the last two layers reading layers 0 and 1's K/V
    "gemma4-shared": ("gemma4_text", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                                          sliding_window=4, layer_types=_FOUR, hidden_size_per_layer_input=16,
                                          vocab_size_per_layer_input=128, num_kv_shared_layers=2)),
    "gemma3n-shared": ("gemma3n_text", dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                            layer_types=_FOUR, hidden_size_per_layer_input=16,
                                            vocab_size_per_layer_input=128, num_kv_shared_layers=2, laurel_rank=8,
                                            altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4)),
    # sliding layers have twice the KV heads of the full ones; V head dim != K head dim
    "mimo_v2_flash": ("mimo_v2_flash", dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=16, v_head_dim=8,
                                            moe_intermediate_size=32, sliding_window=4, n_routed_experts=4,
                                            num_experts_per_tok=2,
                                            layer_types=["full_attention", "sliding_attention", "full_attention"])),
}


@cache
def _model(case: str) -> torch.nn.Module:
    model_type, overrides = CASES[case]
    return model_from_config(model_type, AutoConfig.for_model(model_type, **{**_BASE, **overrides}))


def _reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    if is_patched(model):
        unpatch(model)
    with torch_threads(1):
        return model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=PAD)


# ------------------------------------------------------------------------------ the cache itself
def test_pools_per_geometry_share_block_tables() -> None:
    geo = [LayerGeometry(2, 8, 8), LayerGeometry(1, 16, 16), LayerGeometry(2, 8, 8), None]
    kv = PagedKVCache(4, None, None, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu",
                      layer_geometry=geo, shared_layers={3: 1})
    assert kv.k_pages(0).shape == (6, 4, 2, 8) and kv.k_pages(1).shape == (6, 4, 1, 16)
    assert kv.k_pages(0).untyped_storage().data_ptr() == kv.k_pages(2).untyped_storage().data_ptr()  # one pool
    assert kv.k_pages(3) is kv.k_pages(1)  # the reader sees its owner's pages
    groups = kv.groups()
    assert [(g.geometry, g.layers, g.readers) for g in groups] == [
        (LayerGeometry(2, 8, 8), (0, 2), ()), (LayerGeometry(1, 16, 16), (1,), (3,))]
    assert [g.bytes_per_block for g in groups] == [2 * 4 * 2 * 16 * 4, 4 * 1 * 32 * 4]
    assert kv.bytes_per_block() == sum(g.bytes_per_block for g in groups)
    assert kv.allocated_bytes() == kv.num_blocks * kv.bytes_per_block()  # the reader allocates nothing
    kv.add_sequence("a")
    plan = kv.plan(["a"], [5])
    k0, k1 = torch.randn(5, 2, 8), torch.randn(5, 1, 16)
    kv.write(0, k0, k0, plan)
    kv.write(1, k1, k1, plan)
    got0, _, _ = kv.gather(0, ["a"])
    got3, _, _ = kv.gather(3, ["a"])
    assert torch.equal(got0[0], k0) and torch.equal(got3[0], k1)
    with pytest.raises(ValueError, match=r"layer 1 got K/V with \(Hk, D\) = \(2, 8\)"):
        kv.write(1, k0, k0, plan)
    kv.grow(9)  # every pool grows, contents and the sharing kept
    assert kv.k_pages(1).shape[0] == 9 and kv.k_pages(3) is kv.k_pages(1)
    assert torch.equal(kv.gather(3, ["a"])[0][0], k1)


def test_plain_cache_keeps_one_pool() -> None:
    kv = PagedKVCache(3, 2, 8, num_blocks=4, block_size=2, dtype=torch.float32, device="cpu")
    assert len(kv.groups()) == 1 and kv.groups()[0].layers == (0, 1, 2)
    assert kv.bytes_per_block() == 3 * 2 * 2 * 16 * 4


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(layer_geometry=[LayerGeometry(2, 8, 8)]), r"layer_geometry has 1 entries for 2 layers"),
    (dict(layer_geometry=[LayerGeometry(0, 8, 8), None]), r"layer 0 has geometry .*must be >= 1"),
    (dict(shared_layers={1: 1}), r"shared_layers maps layer 1 to layer 1"),
    (dict(shared_layers={1: 5}), r"shared_layers maps layer 1 to layer 5"),
])
def test_bad_geometry_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PagedKVCache(2, 2, 8, num_blocks=4, block_size=2, dtype=torch.float32, **kwargs)


# ------------------------------------------------------------------ models against transformers
@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_transformers(case: str) -> None:
    model = _model(case)
    ids, mask = left_padded_batch([5, 9], seed=1)
    ref = _reference(model, ids, mask)
    with flashpage.patched(model), torch_threads(1):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=PAD)
        cache = getattr(got, "cache", None) or got.past_key_values
        stats = cache.memory_stats()
    for row in range(ids.shape[0]):
        match = compare_greedy(ref.sequences[row, ids.shape[1]:].tolist(), got.sequences[row, ids.shape[1]:].tolist(),
                               [step[row] for step in ref.logits])
        assert match.ok, match.explain()
    for a, b in zip(ref.logits, got.logits, strict=False):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    # memory stats count each pool with its own geometry
    assert stats.groups and stats.bytes_allocated == sum(g.bytes_per_block for g in stats.groups) * stats.num_blocks


@pytest.mark.parametrize("case", list(CASES))
def test_llm_matches_transformers(case: str) -> None:
    model = _model(case)
    ids, mask = left_padded_batch([5, 9], seed=2)
    ref = _reference(model, ids, mask)
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
    with torch_threads(1):
        llm = flashpage.LLM(model, num_blocks=32, block_size=4, max_num_seqs=4, max_model_len=128)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=0), use_tqdm=False)
            stats = llm.stats()
        finally:
            unpatch(model)
    for row, out in enumerate(outs):
        got = out.outputs[0]
        ref_tokens = ref.sequences[row, ids.shape[1]:].tolist()
        ref_logits = [step[row] for step in ref.logits]
        match = compare_greedy(ref_tokens, got.token_ids, ref_logits)
        assert match.ok, match.explain()
        for step, (tok, lp) in enumerate(zip(got.token_ids[: match.position], got.logprobs,
                                             strict=False)):
            want = torch.log_softmax(ref_logits[step].double(), -1)[tok].item()
            assert abs(lp.logprob - want) < 1e-4, (step, lp.logprob, want)
    geometries = {g.geometry for g in stats.kv_groups}
    expected = {g for g in llm.sizing.layer_geometry if g is not None}
    assert geometries == expected and len(expected) == (1 if case == "gemma3n-shared" else 2)
    assert stats.kv_bytes == stats.blocks_total * sum(g.bytes_per_block for g in stats.kv_groups)
    readers = {r for g in stats.kv_groups for r in g.readers}
    assert readers == set(llm.kv.shared_layers)
