"""flashpage.LLM on models whose K/V change after ``cache.update`` (the dense view) equals unpatched generate().

MLA models (DeepSeek-V2/V3, GLM-4-MoE-Lite, MiniCPM3, ...) page their compressed latents and expand
them after the cache; DiffLlama splits V, JetMoE repeats K/V per expert. In the engine's packed
``[1, T]`` step the cache hands each scheduled sequence's whole K/V back to back
(``HFPagedCache.step_kv``), the model transforms them per token, and flashpage's attention runs
varlen attention over them (``cu_seqlens_q`` over the step's tokens, ``cu_seqlens_k`` over the
sequences' keys, causal bottom-right). Checked against unpatched greedy generate() per prompt, token
for token (a difference only at a reference tie) with every chosen token's log-probability within
1e-4: batches whose steps mix prefill chunks and decodes, prefix-cache hits, preemption in a tiny
pool, forked samples; and the two key layouts of ``step_kv`` on their own. The MLA hybrids
(Kimi-Linear, Ling hybrid), whose steps are ``[B, L]`` rows, are in test_hybrid_llm.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import sweep_models as sm
import torch
from engine_helpers import hf_greedy

from flashpage import LLM, SamplingParams
from flashpage.cache import PagedKVCache
from flashpage.patches import HFPagedCache
from flashpage.patches.patching import patch_state
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

MAX_NEW = 8
TOL = 1e-4
TYPES = ["deepseek_v3", "glm4_moe_lite", "minicpm3", "diffllama", "jetmoe"]


def _model(models: dict[str, torch.nn.Module], model_type: str) -> torch.nn.Module:
    if model_type not in models:
        models[model_type] = sm.build_model(model_type)
    return models[model_type]


def _prompts(n: int, lo: int, hi: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [(prefix or []) + torch.randint(3, 99, (k,), generator=g).tolist() for k in lengths]


def _check(model: torch.nn.Module, prompts: list[list[int]], outputs: list[Any]) -> None:
    """Each completion equals the unpatched greedy continuation; chosen logprobs within TOL."""
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, logits = hf_greedy(model, prompt, MAX_NEW)
        match = compare_greedy(ref, out.token_ids, logits)
        assert match.ok, f"prompt of {len(prompt)}: {match.explain()}\nref={ref}\ngot={out.token_ids}"
        upto = match.position if match.position is not None else len(out.token_ids)
        for step in range(upto):
            expected = torch.log_softmax(logits[step].float(), dim=-1)[ref[step]].item()
            assert math.isclose(out.logprobs[step].logprob, expected, abs_tol=TOL), f"step {step}"


def _record_steps(llm: LLM) -> list[tuple[int, int]]:
    """(prefill chunks, decode chunks) of every step the LLM schedules from now on."""
    steps: list[tuple[int, int]] = []
    schedule = llm.scheduler.schedule

    def recording(*args: Any, **kwargs: Any) -> Any:  # schedule(proposals) under speculative decoding
        s = schedule(*args, **kwargs)
        prefill = sum(1 for c in s.chunks if c.start < c.seq.num_prompt)
        steps.append((prefill, len(s.chunks) - prefill))
        return s

    llm.scheduler.schedule = recording
    return steps


PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1)


@pytest.mark.parametrize("model_type", TYPES)
def test_mixed_prefill_and_decode_steps_equal_unpatched(models: dict[str, torch.nn.Module], model_type: str) -> None:
    """Four requests, prompts chunked by an 8-token budget: steps carry prefill chunks and decodes of
    several sequences together, each attending only its own keys."""
    model = _model(models, model_type)
    prompts = _prompts(4, 3, 13, seed=1)
    llm = LLM(model, max_num_batched_tokens=8, num_blocks=64, block_size=4, check_invariants=True)
    assert patch_state(model).family.path == "dense-view"
    steps = _record_steps(llm)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert any(p and d for p, d in steps), steps  # some step mixed prefill chunks and decodes
    assert any(p + d > 1 for p, d in steps)
    _check(model, prompts, [o.outputs[0] for o in outs])
    assert llm.stats().blocks_used == 0


def test_prefix_cache_hits_are_exact(models: dict[str, torch.nn.Module]) -> None:
    """Later requests start from cached latent blocks of an earlier one's prompt."""
    model = _model(models, "deepseek_v3")
    prefix = _prompts(1, 12, 12, seed=2)[0]
    first = [prefix + [5, 6]]
    later = _prompts(3, 2, 6, seed=3, prefix=prefix)
    llm = LLM(model, num_blocks=64, block_size=4, check_invariants=True)
    _check(model, first, [o.outputs[0] for o in llm.generate(first, PARAMS, use_tqdm=False)])
    outs = llm.generate(later, PARAMS, use_tqdm=False)
    assert llm.stats().prefix_cache_hit_rate > 0
    _check(model, later, [o.outputs[0] for o in outs])


@pytest.mark.parametrize("model_type", ["deepseek_v2", "diffllama"])
def test_preemption_recomputes_exactly(models: dict[str, torch.nn.Module], model_type: str) -> None:
    model = _model(models, model_type)
    prompts = _prompts(4, 5, 11, seed=4)
    llm = LLM(model, num_blocks=8, block_size=4, max_num_batched_tokens=16, check_invariants=True)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.stats().preemptions > 0
    _check(model, prompts, [o.outputs[0] for o in outs])


def test_forked_samples_read_the_shared_blocks(models: dict[str, torch.nn.Module]) -> None:
    """n=3 greedy samples share the prompt's latent blocks (copy-on-write of the partial one)."""
    model = _model(models, "jetmoe")
    prompts = _prompts(2, 6, 10, seed=5)
    llm = LLM(model, num_blocks=64, block_size=4, check_invariants=True)
    outs = llm.generate(prompts, SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0, logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(model, [prompt] * 3, out.outputs)


def test_compile_is_declined_with_a_warning(models: dict[str, torch.nn.Module]) -> None:
    model = _model(models, "deepseek_v3")
    with pytest.warns(UserWarning, match="dense view"):
        llm = LLM(model, num_blocks=16, block_size=4, compile=True)
    assert llm._compiled is None
    prompts = _prompts(1, 4, 4, seed=6)
    _check(model, prompts, [llm.generate(prompts, PARAMS, use_tqdm=False)[0].outputs[0]])


def test_step_kv_layouts() -> None:
    """Packed (one input row): the sequences' keys back to back, as cu_seqlens_k splits them; one row per
    sequence: right-padded with zeros; step_keys turns either back into the packed rows."""
    kv = PagedKVCache(1, 2, 3, v_head_dim=5, num_blocks=8, block_size=2, dtype=torch.float32)
    lengths = [3, 5]
    for s, n in enumerate(lengths):
        kv.add_sequence(s)
        plan = kv.plan([s], [n])
        kv.write(0, torch.randn(n, 2, 3), torch.randn(n, 2, 5), plan)
    k_ref, v_ref, _ = kv.gather(0, [0, 1])
    packed_k = torch.cat([k_ref[i, :n] for i, n in enumerate(lengths)])  # (8, 2, 3)
    packed_v = torch.cat([v_ref[i, :n] for i, n in enumerate(lengths)])
    cache = HFPagedCache.wrap(kv)
    cache.set_plan(kv.plan([0, 1], [1, 1]))  # a decode step of both (one new slot each, unwritten)
    new = [n + 1 for n in lengths]
    k, v = cache.step_kv(0, torch.float32, rows=1)
    assert k.shape == (1, 2, sum(new), 3) and v.shape == (1, 2, sum(new), 5)
    keep = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8])  # each sequence's stored keys (the new slot is last)
    assert torch.equal(k[0].transpose(0, 1)[keep], packed_k) and torch.equal(v[0].transpose(0, 1)[keep], packed_v)
    assert torch.equal(cache.step_keys(k), k[0].transpose(0, 1))
    k2, v2 = cache.step_kv(0, torch.float32, rows=2)
    assert k2.shape == (2, 2, max(new), 3)
    assert torch.equal(k2[0, :, new[0]:], torch.zeros(2, max(new) - new[0], 3))  # right padding
    assert torch.equal(cache.step_keys(k2), cache.step_keys(k)) and torch.equal(cache.step_keys(v2), cache.step_keys(v))
    with pytest.raises(RuntimeError, match="one row per sequence"):
        cache.step_kv(0, torch.float32, rows=3)
