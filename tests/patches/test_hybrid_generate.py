"""Patched generate() on hybrid linear-attention / SSM models equals unpatched generate().

For every type in ``hybrid_zoo.HYBRIDS`` (Qwen3-Next, Qwen3.5 (+MoE), Nemotron-H, Granite-4
(granitemoehybrid), LFM2 (+MoE), Jamba, Falcon-H1, Bamba, Zamba, Zamba2, OLMo-Hybrid and the pure
state-space Mamba, Mamba-2, Falcon-Mamba): a left-padded batch, greedy, tokens equal (a difference
only at a reference tie) and every step's logits within 1e-4. The paged cache must really be used
(its attention layers hold pages, its state layers are transformers' own linear-attention layers).
Then the generate() features that move rows of state: sampling with ``num_return_sequences``,
beam search, a second call continuing a returned cache, and memory reporting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hybrid_zoo import HYBRIDS, PURE_SSM, tiny_hybrid
from model_zoo import left_padded_batch
from transformers import DynamicCache

import flashpage
from flashpage.patches import HFPagedCache
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

PROMPTS = [5, 9, 7]
MAX_NEW = 10
TOL = 1e-4


def _both(model: torch.nn.Module, run: Callable[[], Any], seed: int = 0) -> tuple[Any, Any, list[HFPagedCache]]:
    """``run()`` unpatched, then patched; also the HFPagedCaches the patched run planned forwards on."""
    used: list[HFPagedCache] = []
    original = HFPagedCache.begin_forward

    def spy(self: HFPagedCache, *args: Any, **kwargs: Any) -> None:
        if self not in used:
            used.append(self)
        return original(self, *args, **kwargs)

    torch.manual_seed(seed)
    ref = run()
    flashpage.patch(model)
    HFPagedCache.begin_forward = spy
    try:
        torch.manual_seed(seed)
        got = run()
    finally:
        HFPagedCache.begin_forward = original
        flashpage.unpatch(model)
    return ref, got, used


def _greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Callable[[], Any]:
    return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_greedy_left_padded_equals_unpatched(model_type: str) -> None:
    model = tiny_hybrid(model_type)
    ids, mask = left_padded_batch(PROMPTS)
    ref, got, caches = _both(model, _greedy(model, ids, mask))
    assert len(caches) == 1
    cache = caches[0]
    assert cache.state_layers, "the cache kept no linear-attention / SSM layer"
    if model_type in PURE_SSM:
        assert len(cache.state_layers) == cache.num_layers and cache.memory_stats().blocks_in_use == 0
    else:
        assert cache.kv.allocated_bytes() > 0  # its attention layers are paged
    width = ids.shape[1]
    for row in range(len(PROMPTS)):
        logits = [s[row] for s in ref.scores]
        match = compare_greedy(ref.sequences[row, width:].tolist(), got.sequences[row, width:].tolist(), logits)
        assert match.ok, f"{model_type} row {row}: {match.explain()}"
    for step, (a, b) in enumerate(zip(ref.scores, got.scores, strict=True)):
        assert (a - b).abs().max().item() < TOL, f"{model_type}: logits differ at step {step}"


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_sampling_num_return_sequences(model_type: str) -> None:
    model = tiny_hybrid(model_type)
    ids, mask = left_padded_batch(PROMPTS)
    ref, got, _ = _both(model, lambda: model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                                      do_sample=True, temperature=1.5, top_k=20,
                                                      num_return_sequences=2))
    assert ref.shape[0] == 2 * len(PROMPTS)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("model_type", ["lfm2", "jamba"])
def test_beam_search_reorders_states(model_type: str) -> None:
    model = tiny_hybrid(model_type)
    ids, mask = left_padded_batch(PROMPTS[:2])
    ref, got, _ = _both(model, lambda: model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3,
                                                      do_sample=False))
    assert torch.equal(ref, got)


def test_returned_cache_continues() -> None:
    """A second generate() on the returned cache continues conversation and states exactly."""
    model = tiny_hybrid("qwen3_next")
    ids, mask = left_padded_batch(PROMPTS[:2])

    def two_turns() -> torch.Tensor:
        first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               return_dict_in_generate=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        more = torch.full((2, 3), 7, dtype=torch.long)
        seqs = torch.cat([first.sequences, more], dim=1)
        full_mask = torch.cat([mask, torch.ones((2, seqs.shape[1] - mask.shape[1]), dtype=mask.dtype)], dim=1)
        return model.generate(seqs, attention_mask=full_mask, past_key_values=cache, max_new_tokens=4,
                              do_sample=False)

    ref, got, caches = _both(model, two_turns)
    assert len(caches) == 1
    assert torch.equal(ref, got)


def test_memory_stats_count_states_as_dynamic_cache_holds_them() -> None:
    model = tiny_hybrid("qwen3_next")
    ids, mask = left_padded_batch(PROMPTS)
    ref, got, caches = _both(model, _greedy(model, ids, mask))
    dynamic = ref.cache if hasattr(ref, "cache") else ref.past_key_values
    assert isinstance(dynamic, DynamicCache)
    expected = sum(t.numel() * t.element_size() for layer in dynamic.layers if hasattr(layer, "conv_states")
                   for states in (layer.conv_states, layer.recurrent_states) for t in states.values()
                   if t is not None)
    stats = caches[0].memory_stats()
    assert expected > 0 and stats.state_bytes == expected
    assert stats.bytes_in_use > stats.state_bytes  # plus the attention layer's pages


def test_failed_forward_after_prefill_refuses_to_continue() -> None:
    """States cannot be rolled back: a forward that fails part-way loses the cache, and says so."""
    model = tiny_hybrid("lfm2")
    ids, mask = left_padded_batch(PROMPTS[:2])
    flashpage.patch(model)
    try:
        cache = HFPagedCache(model.config)
        model(ids, attention_mask=mask, past_key_values=cache)
        conv = model.model.layers[2].conv

        def boom(*args: Any, **kwargs: Any) -> None:
            raise KeyError("boom")

        handle = conv.register_forward_pre_hook(boom)
        step = torch.ones((2, 1), dtype=torch.long)
        step_mask = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], dim=1)
        with pytest.raises(KeyError):
            model(step, attention_mask=step_mask, past_key_values=cache)
        handle.remove()
        with pytest.raises(RuntimeError, match="cannot be rolled back"):
            model(step, attention_mask=step_mask, past_key_values=cache)
        cache.reset()
        model(ids, attention_mask=mask, past_key_values=cache)  # usable again after reset()
    finally:
        flashpage.unpatch(model)


def test_prompt_lookup_crops_conv_states() -> None:
    """LFM2 has conv states only, which transformers can crop: assisted (prompt-lookup) decoding
    rolls back the pages and the recorded conv inputs together."""
    model = tiny_hybrid("lfm2")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # assisted decoding takes one row
    ref, got, caches = _both(model, lambda: model.generate(ids, prompt_lookup_num_tokens=3, do_sample=False,
                                                           max_new_tokens=8))
    assert caches and torch.equal(ref, got)
