"""SamplingParams fields, seeds, n-sample forks, streaming and abort on flashpage.LLM."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import hf_greedy, random_prompts

from flashpage import LLM, SamplingParams
from flashpage.patches import unpatch


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, block_size=8, num_blocks=512, check_invariants=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 4, 30, seed=5)


def _gen(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def test_seeded_sampling_is_batch_independent(llm, prompts):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=0.7, top_k=5) for _ in prompts[1:]]
    batched = llm.generate(prompts, [params, *others], use_tqdm=False)[0].token_ids
    assert alone == batched
    again = llm.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=1.0, seed=1235),
                         use_tqdm=False)[0].token_ids
    assert again != alone  # the seed matters


def test_unseeded_sampling_varies(llm, prompts):
    outs = _gen(llm, [prompts[1]] * 4, max_tokens=16, temperature=1.5)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_n_samples_share_prompt_blocks(llm, model, prompts):
    prompt = random_prompts(1, 40, 40, seed=7)[0]  # 5 full blocks of 8
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    llm.add_request(prompt, params, request_id="fork")
    while True:
        llm.step()
        group = llm._groups.get("fork")
        if group is None or len(group.seqs) == 4:
            break
    # after the fork: 4 samples, prompt blocks shared (refcount), not 4 copies
    assert llm.stats().blocks_used <= 5 + 4 + 1
    outs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outs[out.request_id] = out
    out = outs["fork"]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.stats().blocks_used == 0


def test_n_samples_greedy_are_equal(llm, prompts):
    out = _gen(llm, [prompts[2]], n=3, max_tokens=8, temperature=0.0)[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 1


def test_stream_token_ids_concatenate_to_generate(llm, prompts):
    params = SamplingParams(max_tokens=10, temperature=0.0)
    want = [o.token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
    got: dict[str, list[int]] = {}
    finished = set()
    for delta in llm.stream(prompts[:3], params):
        assert delta.request_id not in finished
        got.setdefault(delta.request_id, []).extend(delta.token_ids)
        if delta.finished:
            finished.add(delta.request_id)
    assert len(finished) == 3
    assert [got[k] for k in sorted(got, key=int)] == want


def test_abort_frees_every_block(llm, prompts):
    ids = [llm.add_request(p, SamplingParams(max_tokens=50, temperature=0.0)) for p in prompts]
    for _ in range(3):
        llm.step()
    assert llm.stats().blocks_used > 0
    for rid in ids:
        llm.abort(rid)
    assert llm.stats().blocks_used == 0
    llm.kv.blocks.check_invariants()
    llm.abort(ids[0])  # again: a no-op, as is an unknown id
    llm.abort("no-such-request")
    assert llm.has_unfinished_requests()  # the aborted outputs are still to be reported
    reported = llm.step()
    assert sorted(o.request_id for o in reported) == sorted(ids)
    assert all(o.finished and o.finish_reason == "abort" for o in reported)
    assert not llm.has_unfinished_requests() and llm.step() == []  # reported once
    llm.abort(ids[0])  # an ended request: still a no-op
    assert not llm.has_unfinished_requests()


def test_max_tokens_and_length_reason(llm, prompts):
    outs = _gen(llm, prompts[:3], max_tokens=5, temperature=0.0, ignore_eos=True)
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs)


def test_top_k_1_top_p_tiny_min_p_1_equal_greedy(llm, prompts):
    greedy = [o.token_ids for o in _gen(llm, prompts[:3], max_tokens=8, temperature=0.0, ignore_eos=True)]
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        outs = _gen(llm, prompts[:3], max_tokens=8, temperature=1.0, ignore_eos=True, seed=0, **kw)
        assert [o.token_ids for o in outs] == greedy, kw


def test_repetition_penalty_matches_hf(llm, model, prompts):
    outs = _gen(llm, prompts, max_tokens=10, temperature=0.0, repetition_penalty=1.8, ignore_eos=True)
    plain = _gen(llm, prompts, max_tokens=10, temperature=0.0, ignore_eos=True)
    unpatch(model)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    assert any(p.token_ids != o.token_ids for p, o in zip(plain, outs, strict=True))


def test_presence_and_frequency_penalties_reduce_repeats(llm, prompts):
    def repeats(ids):
        return len(ids) - len(set(ids))

    base = _gen(llm, prompts[:4], max_tokens=24, temperature=0.0, ignore_eos=True)
    pres = _gen(llm, prompts[:4], max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=2.0)
    freq = _gen(llm, prompts[:4], max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=2.0)
    assert sum(repeats(o.token_ids) for o in pres) < sum(repeats(o.token_ids) for o in base)
    assert sum(repeats(o.token_ids) for o in freq) < sum(repeats(o.token_ids) for o in base)


def test_stop_token_ids_and_min_tokens(llm, prompts):
    base = _gen(llm, [prompts[4]], max_tokens=12, temperature=0.0, ignore_eos=True)[0].token_ids
    stop = base[3]
    first = base.index(stop)
    out = _gen(llm, [prompts[4]], max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])[0]
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop"
    late = _gen(llm, [prompts[4]], max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
                min_tokens=first + 2)[0]
    assert len(late.token_ids) >= first + 2
    assert stop not in late.token_ids[: first + 1]


def test_min_tokens_suppresses_eos(llm, model, prompts):
    base = _gen(llm, [prompts[5]], max_tokens=6, temperature=0.0, ignore_eos=True)[0].token_ids
    eos_llm = LLM(model, block_size=8, num_blocks=128)
    eos_llm.sampler.eos_token_ids = frozenset({base[0]})  # the first greedy token acts as EOS
    stopped = eos_llm.generate([prompts[5]], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    assert stopped.token_ids == [base[0]] and stopped.finish_reason == "stop"
    held = eos_llm.generate([prompts[5]], SamplingParams(max_tokens=6, min_tokens=3, temperature=0.0),
                            use_tqdm=False)[0]
    assert base[0] not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_logprobs_match_log_softmax_of_reference(llm, model, prompts):
    out = _gen(llm, [prompts[0]], max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)[0]
    ref_tokens, ref_logits = hf_greedy(model, prompts[0], 6, eos=False)
    assert out.token_ids == ref_tokens
    assert len(out.logprobs) == 6
    for lp, logits in zip(out.logprobs, ref_logits, strict=True):
        ref = torch.log_softmax(logits.float(), -1)
        assert math.isclose(lp.logprob, float(ref[lp.token_id]), abs_tol=1e-4)
        top = ref.topk(3)
        assert list(lp.top) == top.indices.tolist()
        assert all(math.isclose(lp.top[t], float(v), abs_tol=1e-4)
                   for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True))


def test_temperature_changes_distribution(llm, prompts):
    """Seeded, so deterministic: a cold temperature stays on (near) greedy, a hot one spreads out."""
    def sample(temperature: float) -> set[tuple[int, ...]]:
        params = [SamplingParams(max_tokens=10, temperature=temperature, ignore_eos=True, seed=s) for s in range(8)]
        return {tuple(o.token_ids) for o in llm.generate([prompts[1]] * 8, params, use_tqdm=False)}

    cold, hot = sample(0.05), sample(3.0)
    greedy = tuple(_gen(llm, [prompts[1]], max_tokens=10, temperature=0.0, ignore_eos=True)[0].token_ids)
    assert greedy in cold, "at temperature 0.05 some seed must reproduce the greedy tokens"
    assert len(hot) > len(cold), (len(hot), len(cold))


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("min_tokens", -1), ("temperature", -0.1),
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_k", -2), ("top_p", 0.0),
    ("top_p", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("repetition_penalty", 0.0),
    ("repetition_penalty", float("nan")), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("seed", -1),
    ("logprobs", 21), ("logprobs", -1), ("n", 0), ("n", True),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
