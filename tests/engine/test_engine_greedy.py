"""flashpage.LLM greedy output equals transformers' generate() run one prompt at a time.

Covered: plain continuous batching, prefix caching on and off (with shared prefixes so it hits),
a KV pool small enough to force preemption, and a token budget small enough to chunk prompts.
The block invariant is checked after every step (LLM(check_invariants=True)).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_matches_hf, random_prompts

from flashpage import LLM, SamplingParams
from flashpage.kernels import cpu_attention

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts(1, 40, 40, seed=99)[0]
    return random_prompts(14, 1, 60, seed=1) + random_prompts(8, 2, 20, seed=2, prefix=shared)


def _run(model, prompts, **llm_kwargs):
    llm = LLM(model, check_invariants=True, **llm_kwargs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), use_tqdm=False)
    stats = llm.stats()
    assert stats.blocks_used == 0, "blocks leaked after every request finished"
    llm.kv.blocks.check_invariants()
    return outs, stats


def test_batch_equals_hf_one_by_one(model, prompts):
    outs, stats = _run(model, prompts, block_size=16, num_blocks=256)
    assert len(prompts) >= 20
    assert [o.prompt_token_ids for o in outs] == prompts
    identical = assert_matches_hf(model, prompts, outs, MAX_NEW)
    assert identical >= len(prompts) - 1
    assert all(o.finished and o.finish_reason in ("stop", "length") for o in outs)


def test_prefix_caching_on_hits_and_matches(model, prompts):
    outs, stats = _run(model, prompts, block_size=8, num_blocks=256, enable_prefix_caching=True,
                       max_num_seqs=4)
    assert stats.prefix_cache_hit_rate > 0.1
    assert sum(o.metrics.cached_prompt_tokens for o in outs) > 0
    assert_matches_hf(model, prompts, outs, MAX_NEW)


def test_shared_prefix_decodes_take_the_cascade(model, monkeypatch):
    """Decodes behind a shared prefix take the CPU kernel's cascade (the shared pages once, the queries of
    all the sequences stacked): their tokens equal transformers', and their logprobs differ from the
    per-sequence path's by float rounding only (not to the bit: the cascade ran)."""
    if cpu_attention.status().name != "cpp" or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("the cascade is on the C++ kernel's float32 AVX-512 path")
    shared = random_prompts(1, 64, 64, seed=7)[0]
    prompts = random_prompts(8, 2, 10, seed=8, prefix=shared)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=1)
    runs = {}
    for cascade in (True, False):
        monkeypatch.setattr(cpu_attention, "_CASCADE", cascade)
        llm = LLM(model, block_size=16, num_blocks=64, enable_prefix_caching=True, check_invariants=True)
        runs[cascade] = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_hf(model, prompts, runs[True], MAX_NEW)
    on = [lp.logprob for o in runs[True] for lp in o.logprobs]
    off = [lp.logprob for o in runs[False] for lp in o.logprobs]
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    assert max(abs(a - b) for a, b in zip(on, off, strict=True)) < 1e-4
    assert on != off


def test_prefix_caching_off(model, prompts):
    outs, stats = _run(model, prompts, block_size=8, num_blocks=256, enable_prefix_caching=False,
                       max_num_seqs=4)
    assert stats.prefix_cache_hit_rate == 0.0
    assert all(o.metrics.cached_prompt_tokens == 0 for o in outs)
    assert_matches_hf(model, prompts, outs, MAX_NEW)


def test_tiny_pool_preempts_and_matches(model, prompts):
    outs, stats = _run(model, prompts, block_size=4, num_blocks=24, max_num_batched_tokens=64)
    assert stats.preemptions > 0
    assert sum(o.metrics.preemptions for o in outs) == stats.preemptions
    assert_matches_hf(model, prompts, outs, MAX_NEW)


def test_tiny_token_budget_chunks_and_matches(model, prompts):
    outs, stats = _run(model, prompts, block_size=4, num_blocks=256, max_num_batched_tokens=7)
    assert stats.steps > max(len(p) for p in prompts) // 7
    assert_matches_hf(model, prompts, outs, MAX_NEW)


def test_low_level_api_matches_generate(model, prompts):
    llm = LLM(model, block_size=16, num_blocks=128, check_invariants=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    ids = [llm.add_request(p, params) for p in prompts[:5]]
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == sorted(ids)
    batch = llm.generate(prompts[:5], params, use_tqdm=False)
    assert [finished[i].token_ids for i in ids] == [o.token_ids for o in batch]
