"""Sparse-attention indexers (DeepSeek-V3.2's DSA lightning indexer and its kin) under flashpage.

The indexer keeps its own keys in the cache (``cache.update_indexer``) and hands the attention function
its top-k key positions (``indices``). flashpage keeps the indexer keys in an extra page group of the
pool, addressed by the same block tables as the K/V, and restricts the dense attention to the selected
keys. Checked: the page group itself (writes, gathers, copy-on-write forks, growth, prefix sharing);
patched greedy and beam-search generate() against unpatched generate() on a tiny DeepSeek-V3.2 whose
top-k is smaller than the context (so the selection matters); the no-cache forward (the mask merge); LLM
taking them one sequence per forward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from model_zoo import left_padded_batch
from sweep_configs import VOCAB
from sweep_models import build_model

import flashpage
from flashpage.cache import PagedKVCache
from flashpage.patches import HFPagedCache
from flashpage.patches.hf_cache import INDEXER_GROUP
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

PROMPTS = [9, 6]
MAX_NEW = 8
TOL = 1e-4


# ------------------------------------------------------------------------------- the page group
def _pool(num_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(1, 1, 4, num_blocks=num_blocks, block_size=4, dtype=torch.float32)


def test_extra_pages_follow_the_block_tables() -> None:
    kv = _pool()
    x = torch.arange(6 * 3, dtype=torch.float32).view(6, 1, 3)
    kv.add_sequence("a")
    plan = kv.plan(["a"], [6])
    kv.write_extra("idx", 0, x, plan)
    got, lengths = kv.gather_extra("idx", 0, ["a"])
    assert lengths == [6] and torch.equal(got[0], x)
    # a fork shares the blocks; the partial last block is copied before the fork writes to it
    kv.fork("a", "b")
    plan = kv.plan(["b"], [1])
    kv.write_extra("idx", 0, torch.full((1, 1, 3), -1.0), plan)
    a, _ = kv.gather_extra("idx", 0, ["a"])
    b, _ = kv.gather_extra("idx", 0, ["b"])
    assert torch.equal(a[0], x) and torch.equal(b[0, :6], x) and bool((b[0, 6] == -1).all())
    # growing the pool keeps the side pages' content and block ids
    kv.grow(16)
    again, _ = kv.gather_extra("idx", 0, ["a", "b"])
    assert torch.equal(again[0, :6], x) and torch.equal(again[1], b[0])
    assert kv.allocated_bytes() == 16 * 4 * 3 * 4  # the side pages count (no K/V written here)


def test_extra_pages_are_shared_with_a_prefix_hit() -> None:
    kv = _pool()
    prompt = [5, 6, 7, 8, 9]
    plan = kv.plan(["a"], token_ids=[prompt], new_sequences=True)
    x = torch.randn(5, 1, 2)
    kv.write_extra("idx", 0, x, plan)
    plan = kv.plan(["b"], token_ids=[prompt], new_sequences=True)
    assert plan.context_lens == [4]  # the first full block came from the prefix cache
    kv.write_extra("idx", 0, x[4:], plan)
    got, _ = kv.gather_extra("idx", 0, ["b"])
    assert torch.equal(got[0], x)


def test_extra_pages_refuse_another_shape() -> None:
    kv = _pool()
    kv.add_sequence("a")
    plan = kv.plan(["a"], [2])
    kv.write_extra("idx", 0, torch.zeros(2, 1, 3), plan)
    with pytest.raises(ValueError, match="hold rows of shape"):
        kv.write_extra("idx", 0, torch.zeros(2, 1, 4), plan)
    with pytest.raises(RuntimeError, match="no other pages"):
        kv.gather_extra("other", 0, ["a"])


# ----------------------------------------------------------------------------- DeepSeek-V3.2 DSA
def sweep_batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random left-padded prompts in the sweep models' vocabulary: (input_ids, attention_mask)."""
    return left_padded_batch(lengths, vocab=VOCAB)


@pytest.fixture(scope="module")
def dsa() -> torch.nn.Module:
    model = build_model("deepseek_v32")
    assert model.config.index_topk < min(PROMPTS) + MAX_NEW  # the indexer's selection drops keys
    return model


def _both(model: torch.nn.Module, run: Any) -> tuple[Any, Any, list[HFPagedCache]]:
    used: list[HFPagedCache] = []
    original = HFPagedCache.update_indexer

    def spy(self: HFPagedCache, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self not in used:
            used.append(self)
        return original(self, *args, **kwargs)

    ref = run()
    flashpage.patch(model)
    HFPagedCache.update_indexer = spy
    try:
        got = run()
    finally:
        HFPagedCache.update_indexer = original
        flashpage.unpatch(model)
    return ref, got, used


def test_dsa_greedy_left_padded_equals_unpatched(dsa: torch.nn.Module) -> None:
    ids, mask = sweep_batch(PROMPTS)
    ref, got, caches = _both(dsa, lambda: dsa.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                                       do_sample=False, output_scores=True,
                                                       return_dict_in_generate=True))
    assert len(caches) == 1
    kv = caches[0].kv
    layers = dsa.config.num_hidden_layers
    assert all(kv.has_extra(INDEXER_GROUP, i) for i in range(layers))  # the indexer keys are paged
    width = ids.shape[1]
    for row in range(len(PROMPTS)):
        match = compare_greedy(ref.sequences[row, width:].tolist(), got.sequences[row, width:].tolist(),
                               [s[row] for s in ref.scores])
        assert match.ok, f"row {row}: {match.explain()}"
    for step, (a, b) in enumerate(zip(ref.scores, got.scores, strict=True)):
        assert (a - b).abs().max().item() < TOL, f"logits differ at step {step}"


def test_dsa_beam_search_reorders_indexer_keys(dsa: torch.nn.Module) -> None:
    ids, mask = sweep_batch(PROMPTS)
    ref, got, caches = _both(dsa, lambda: dsa.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3,
                                                       do_sample=False))
    assert caches and torch.equal(ref, got)


def test_dsa_forward_without_cache_keeps_the_selection(dsa: torch.nn.Module) -> None:
    """use_cache=False: the unpatched attention gets the indexer's selection merged into its mask."""
    ids, mask = sweep_batch(PROMPTS)
    with torch.no_grad():
        ref = dsa(ids, attention_mask=mask, use_cache=False).logits
        flashpage.patch(dsa)
        try:
            got = dsa(ids, attention_mask=mask, use_cache=False).logits
        finally:
            flashpage.unpatch(dsa)
    real = mask.bool()
    assert (ref[real] - got[real]).abs().max().item() < TOL


# ------------------------------------------------------------------- selections that live in the mask
def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 4)]


@pytest.mark.parametrize("model_type", ["qwen4_exp_text", "doge"])
def test_mask_edited_by_the_model_is_exact_in_generate_and_run_solo_by_llm(model_type: str) -> None:
    """Qwen4-Exp's indexer and Doge's dynamic mask change the mask after transformers builds it: the
    patched model attends under that very mask (the dense view) in generate(); LLM, whose packed steps
    have no transformers mask, runs them one sequence per forward, as generate() does (engine/solo.py;
    exactness: tests/engine/test_llm_sparse_indexer.py)."""
    from sweep_models import _check_generate, _greedy

    model = build_model(model_type)
    if model_type == "doge":  # A = 0 at init makes its dynamic bias a constant (softmax-invariant): perturb it
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.normal_(0, 1.0)
    prompts = _prompts()
    result = _check_generate(model, prompts, _greedy(model, prompts))
    assert result.outcome == "exact", result.detail
    llm = flashpage.LLM(model, block_size=4, num_blocks=64, compile=False)
    assert llm.solo_reason is not None
    assert "edit the attention mask themselves" in llm.solo_reason or "sparse-attention indexer" in llm.solo_reason
    flashpage.unpatch(model)


def test_llm_runs_a_sparse_indexer_one_sequence_per_forward(dsa: torch.nn.Module) -> None:
    """The engine's packed steps have no padded mask for the indexer to score under: LLM runs the model one
    sequence per forward, as generate() does, naming why (exactness: tests/engine/test_llm_sparse_indexer.py)."""
    llm = flashpage.LLM(dsa, block_size=4, num_blocks=64, compile=False)
    assert llm.solo_reason is not None and "sparse-attention indexer" in llm.solo_reason
    assert llm.scheduler.generate_layout and not llm.stats().prefix_caching
    flashpage.unpatch(dsa)
