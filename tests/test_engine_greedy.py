"""flashpage.LLM greedy output equals transformers' generate() run one prompt at a time.

Covered: plain continuous batching, prefix caching on and off (with shared prefixes so it hits),
a KV pool small enough to force preemption, and a token budget small enough to chunk prompts.
The block invariant is checked after every step (LLM(check_invariants=True)).
"""

from __future__ import annotations

import pytest
from engine_helpers import assert_matches_hf, random_prompts

from flashpage import LLM, SamplingParams

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
