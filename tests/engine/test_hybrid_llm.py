"""flashpage.LLM on hybrid linear-attention / SSM models equals unpatched generate().

The engine keeps per-sequence recurrent states in slots (flashpage/engine/states.py), runs
decodes as [B, 1] rows and every other chunk alone, and switches prefix caching off for such
models. Checked against unpatched greedy generate() per prompt, token for token (a difference only
at a reference tie) with every chosen token's log-probability within 1e-4: a batch with chunked
prompts for each hybrid family, ``n > 1`` (forked samples copy the parent's state), preemption in a
tiny pool (recompute from a fresh state), a forward that fails part-way (the step's sequences start
over), prompt logprobs, the statistics, and pure state-space models (state slots, no pages). The MLA hybrids
(Kimi-Linear, Ling hybrid) take the dense view in their ``[B, L]`` rows: each row's whole latent K/V
read back right-padded, attention varlen over the real keys (test_dense_view_llm.py has the packed step).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_helpers import hf_greedy, random_prompts
from hybrid_zoo import DENSE_VIEW, HYBRIDS, PURE_SSM, tiny_hybrid

import flashpage
from flashpage import LLM, SamplingParams
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

MAX_NEW = 8
TOL = 1e-4
ENGINE_TYPES = [t for t in HYBRIDS if t not in PURE_SSM]


def _model(models: dict[str, torch.nn.Module], model_type: str) -> torch.nn.Module:
    if model_type not in models:
        models[model_type] = tiny_hybrid(model_type)
    return models[model_type]


def _check(model: torch.nn.Module, prompts: list[list[int]], outputs: list[Any], max_new: int = MAX_NEW) -> None:
    """Each completion equals the unpatched greedy continuation; chosen logprobs within TOL."""
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, logits = hf_greedy(model, prompt, max_new)
        match = compare_greedy(ref, out.token_ids, logits)
        assert match.ok, f"prompt of {len(prompt)}: {match.explain()}\nref={ref}\ngot={out.token_ids}"
        upto = match.position if match.position is not None else len(out.token_ids)
        for step in range(upto):
            expected = torch.log_softmax(logits[step].float(), dim=-1)[ref[step]].item()
            assert math.isclose(out.logprobs[step].logprob, expected, abs_tol=TOL), f"step {step}"


@pytest.mark.parametrize("model_type", ENGINE_TYPES)
def test_batched_chunked_greedy_equals_unpatched(models: dict[str, torch.nn.Module], model_type: str) -> None:
    model = _model(models, model_type)
    prompts = random_prompts(4, 3, 13, seed=1)
    llm = LLM(model, max_num_batched_tokens=8, num_blocks=64, block_size=4, check_invariants=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1), use_tqdm=False)
    _check(model, prompts, [o.outputs[0] for o in outs])
    stats = llm.stats()
    assert stats.prefix_caching is False
    assert stats.state_bytes_per_seq > 0 and stats.kv_bytes_per_token > 0
    assert stats.blocks_used == 0 and not llm._states.slot_of  # every slot and block given back
    state_only = {i for i, t in enumerate(llm._cache.layer_types) if t in ("linear_attention", "conv")}
    paged = {i for g in stats.kv_groups for i in g.layers}
    assert paged and not paged & state_only  # pages only for layers that attend


def test_n_samples_fork_the_state(models: dict[str, torch.nn.Module]) -> None:
    """Greedy samples of one request: each child continues from a copy of the parent's state."""
    model = _model(models, "qwen3_next")
    prompts = random_prompts(2, 6, 10, seed=2)
    llm = LLM(model, max_num_batched_tokens=32, num_blocks=64, block_size=4)
    outs = llm.generate(prompts, SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0, logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs) == 3
        _check(model, [prompt] * 3, out.outputs)


def test_seeded_samples_do_not_depend_on_batching(models: dict[str, torch.nn.Module]) -> None:
    """Seeded sampling with n=2: the same tokens alone, batched, and under preemption."""
    model = _model(models, "granitemoehybrid")
    prompts = random_prompts(3, 4, 9, seed=3)
    params = SamplingParams(n=2, max_tokens=MAX_NEW, temperature=1.3, top_k=30, seed=7, ignore_eos=True)
    alone = [LLM(model, num_blocks=64, block_size=4).generate([p], params, use_tqdm=False)[0] for p in prompts]
    tight = LLM(model, num_blocks=7, block_size=4, max_num_batched_tokens=8)
    batched = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats().preemptions > 0
    for a, b in zip(alone, batched, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h", "lfm2", *DENSE_VIEW])
def test_preemption_recomputes_from_a_fresh_state(models: dict[str, torch.nn.Module], model_type: str) -> None:
    model = _model(models, model_type)
    prompts = random_prompts(4, 5, 11, seed=4)
    llm = LLM(model, num_blocks=8, block_size=4, max_num_batched_tokens=16, check_invariants=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1), use_tqdm=False)
    assert llm.stats().preemptions > 0
    _check(model, prompts, [o.outputs[0] for o in outs])


def test_failed_forward_restarts_the_steps_sequences(models: dict[str, torch.nn.Module]) -> None:
    """A forward failing part-way (after other forwards of the step advanced states): the step's
    sequences recompute from scratch; the results are still exact."""
    model = _model(models, "jamba")
    prompts = random_prompts(3, 5, 9, seed=5)
    llm = LLM(model, num_blocks=64, block_size=4, max_num_batched_tokens=64)
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1))
    llm.step()  # prompts computed
    llm.step()  # a decode step
    calls = {"n": 0}

    def fail_on_second_forward(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("injected")

    llm.add_request(random_prompts(1, 6, 6, seed=6)[0], SamplingParams(max_tokens=2, temperature=0))
    handle = model.model.register_forward_pre_hook(fail_on_second_forward)  # decodes run, then the new prompt fails
    try:
        with pytest.raises(KeyError):
            llm.step()
    finally:
        handle.remove()
    assert calls["n"] == 2 and all(s.num_computed == 0 for s in llm.scheduler.running)  # all start over
    done: dict[str, Any] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    _check(model, prompts, [done[str(i)].outputs[0] for i in range(3)])


def test_prompt_logprobs(models: dict[str, torch.nn.Module]) -> None:
    model = _model(models, "qwen3_5_text")
    prompt = random_prompts(1, 10, 10, seed=8)[0]
    llm = LLM(model, num_blocks=64, block_size=4, max_num_batched_tokens=4)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = out.prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        assert got[i].token_id == prompt[i]
        assert math.isclose(got[i].logprob, ref[i - 1, prompt[i]].item(), abs_tol=TOL)


@pytest.mark.parametrize("model_type", PURE_SSM)
def test_pure_state_space_models_run_with_state_slots_only(models: dict[str, torch.nn.Module], model_type: str) -> None:
    """No attention layer: no pages at all (blocks only count tokens), every sequence's state in a slot;
    chunked prompts, forked samples and preemption in a tiny pool, all exact."""
    model = _model(models, model_type)
    prompts = random_prompts(4, 3, 13, seed=9)
    llm = LLM(model, max_num_batched_tokens=8, num_blocks=8, block_size=4, check_invariants=True)
    outs = llm.generate(prompts, SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0, logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(model, [prompt] * 2, out.outputs)
    stats = llm.stats()
    assert stats.preemptions > 0
    assert stats.kv_groups == () and stats.kv_bytes_per_token == 0 and stats.kv_bytes == 0
    assert stats.state_bytes_per_seq > 0 and stats.prefix_caching is False
    assert stats.blocks_used == 0 and not llm._states.slot_of


@pytest.mark.parametrize(("model_type", "continues"), [
    ("mamba", False), ("falcon_mamba", False), ("jamba", False), ("zamba", False),
    ("mamba2", True), ("qwen3_next", True), ("bamba", True), ("nemotron_h", True),
])
def test_chunks_continue_states_where_the_model_can(models: dict[str, torch.nn.Module], model_type: str,
                                                     continues: bool) -> None:
    """Mamba-1 mixers restart their scan from zero on a multi-token input: found by a probe at construction,
    such a model's continuing prompt chunks run one token at a time (then exact, see the tests above)."""
    from flashpage.engine.states import continues_chunks

    llm = LLM(_model(models, model_type), num_blocks=16, block_size=4)
    assert llm._token_by_token is not continues
    assert continues_chunks(llm._states_after, list(range(3, 11))) is continues


def test_plain_models_keep_the_packed_path_and_prefix_caching() -> None:
    from engine_helpers import engine_model

    llm = LLM(engine_model(), num_blocks=32, block_size=4)
    try:
        stats = llm.stats()
        assert llm._states is None and stats.prefix_caching and stats.state_bytes_per_seq == 0
    finally:
        flashpage.unpatch(llm.model)


def test_state_slots_grow_fork_release() -> None:
    """The slot pool: contents survive growth, a fork copies, a released slot is reused."""
    from flashpage.engine.states import INITIAL_SLOTS, StateSlots

    slots = StateSlots()
    ids = list(range(INITIAL_SLOTS + 3))  # more live sequences than the first pool holds
    states = {(0, "conv", 0): torch.arange(len(ids) * 6, dtype=torch.float32).reshape(len(ids), 2, 3)}
    slots.scatter(ids[:INITIAL_SLOTS], {k: v[:INITIAL_SLOTS] for k, v in states.items()}, {(0, 0): True})
    slots.scatter(ids[INITIAL_SLOTS:], {k: v[INITIAL_SLOTS:] for k, v in states.items()}, {(0, 0): True})
    assert slots.capacity >= len(ids)
    assert torch.equal(slots.gather(ids)[(0, "conv", 0)], states[(0, "conv", 0)])
    slots.fork(3, "child")
    assert torch.equal(slots.gather(["child"])[(0, "conv", 0)], states[(0, "conv", 0)][3:4])
    slot = slots.slot_of[5]
    slots.release(5)
    assert 5 not in slots.slot_of and slots.slot("new") == slot
    assert slots.bytes_per_sequence() == 6 * 4
    with pytest.raises(RuntimeError, match="not of fixed size"):
        slots.scatter([0], {(0, "conv", 0): torch.zeros((1, 2, 4))}, {})


def test_many_live_sequences_grow_the_slots(models: dict[str, torch.nn.Module]) -> None:
    model = _model(models, "lfm2")
    prompts = random_prompts(5, 4, 8, seed=9)
    llm = LLM(model, num_blocks=128, block_size=4)
    outs = llm.generate(prompts, SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0, logprobs=1), use_tqdm=False)
    assert llm._states.capacity > 8  # 10 samples were live at once
    for prompt, out in zip(prompts, outs, strict=True):
        _check(model, [prompt] * 2, out.outputs)


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba"])
def test_equal_length_chunks_share_a_forward(models: dict[str, torch.nn.Module], model_type: str) -> None:
    """Prompts of one length run as one [B, L] forward (fresh states), decodes as one [B, 1]."""
    model = _model(models, model_type)
    prompts = random_prompts(4, 10, 10, seed=10)
    llm = LLM(model, num_blocks=64, block_size=4, max_num_batched_tokens=40)
    forwards: list[tuple[int, ...]] = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: forwards.append(tuple(kw["input_ids"].shape)),
                                             with_kwargs=True)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1), use_tqdm=False)
    finally:
        handle.remove()
    assert forwards[:2] == [(4, 10), (4, 1)]
    _check(model, prompts, [o.outputs[0] for o in outs])


def test_split_forwards_groups_rows_that_can_share_an_input() -> None:
    from types import SimpleNamespace

    from flashpage.engine.states import split_forwards

    def chunk(start: int, n: int) -> SimpleNamespace:
        return SimpleNamespace(start=start, num_tokens=n)

    chunks = [chunk(7, 1), chunk(0, 5), chunk(4, 1), chunk(8, 5), chunk(0, 5), chunk(3, 5), chunk(0, 1)]
    forwards = split_forwards(chunks)
    index = {id(c): i for i, c in enumerate(chunks)}
    got = sorted((f.fresh, tuple(index[id(c)] for c in f.chunks), f.offsets) for f in forwards)
    assert got == [(False, (0, 2), (0, 6)), (False, (3, 5), (7, 17)), (True, (1, 4), (1, 12)), (True, (6,), (22,))]


def test_random_load_with_aborts_preemption_and_forks(models: dict[str, torch.nn.Module]) -> None:
    """Requests arriving over time (n = 1..3), random aborts, a pool so small that sequences are
    preempted: every completed sample equals unpatched greedy, and no state slot outlives its
    sequence at any step."""
    import random

    model = _model(models, "qwen3_next")
    rng = random.Random(0)
    llm = LLM(model, num_blocks=12, block_size=4, max_num_batched_tokens=10, max_num_seqs=5, check_invariants=True)
    prompts = random_prompts(16, 2, 14, seed=3)
    pending, sent, aborted, done = list(enumerate(prompts)), {}, set(), {}
    while pending or llm.has_unfinished_requests():
        while pending and rng.random() < 0.5:
            i, prompt = pending.pop(0)
            rid = llm.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 8), temperature=0,
                                                         n=rng.choice([1, 1, 2, 3]), ignore_eos=True))
            sent[rid] = i
        if rng.random() < 0.05 and sent:
            rid = rng.choice(sorted(sent))
            llm.abort(rid)
            aborted.add(rid)
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
        live = {s.seq_id for s in llm.scheduler.running} | {s.seq_id for s in llm.scheduler.waiting}
        assert set(llm._states.slot_of) <= live
    assert llm.stats().preemptions > 0 and len(done) == len(prompts)
    for rid, out in done.items():
        if rid in aborted:
            continue
        ref, logits = hf_greedy(model, prompts[sent[rid]], len(out.outputs[0].token_ids), eos=False)
        for sample in out.outputs:
            match = compare_greedy(ref, sample.token_ids, logits)
            assert match.ok, f"request {rid} sample {sample.index}: {match.explain()}"


def test_compile_request_warns_and_runs_eagerly(models: dict[str, torch.nn.Module]) -> None:
    model = _model(models, "lfm2")
    with pytest.warns(UserWarning, match="recurrent"):
        llm = LLM(model, num_blocks=32, block_size=4, compile=True)
    assert llm._compiled is None
    prompts = random_prompts(2, 4, 6, seed=11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, logprobs=1), use_tqdm=False)
    _check(model, prompts, [o.outputs[0] for o in outs], max_new=4)
