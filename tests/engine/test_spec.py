"""Speculative decoding (n-gram prompt lookup) in flashpage.LLM: exact against the same LLM without it.

Greedy outputs must be token-identical to the engine without speculation (batch 1 and 8, on the built-in
tiny model and on the engine test model), and so must seeded samples (the verifier draws one noise vector
per emitted token from the sequence's generator); stop strings, EOS, max_tokens, n > 1, preemption,
logprobs and structured outputs keep working; rejected tokens never stay in the prefix cache.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import engine_model, random_prompts

from flashpage import LLM, SamplingParams
from flashpage.engine.outputs import RequestMetrics
from flashpage.engine.sequence import Group, Seq
from flashpage.engine.spec import PROBE_PERIOD, NgramIndex, SpeculativeConfig, Speculator, worth_proposing
from flashpage.engine.structured import StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown",
         "Return a new list of the items. Return a new list of the",
         "import os\nimport sys\nimport os\nimport",
         "Raise an exception if the value is not a string. Raise an exception if the value is",
         "The list of items is", "def f(x):\n    return x\ndef g(x):\n    return",
         "a b c d e f g a b c d e f g a b c", "Repeat after me: hello world, hello world, hello"]


@pytest.fixture(scope="module")
def tiny_pair(tiny):
    """The tiny model's LLM without and with speculation (check_invariants on the speculating one)."""
    return LLM(*tiny, max_num_seqs=64), LLM(*tiny, max_num_seqs=64, speculative_config=NGRAM, check_invariants=True)


def _ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _copy_prompts(n: int, seed: int) -> list[list[int]]:
    """Random-token prompts that repeat their first half (the n-gram lookup finds something to propose)."""
    return [p + p[:len(p) // 2] for p in random_prompts(n, 8, 24, seed=seed)]


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("bad, words", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive int"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min=5"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown key(s) ['lookahead']"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size must be"),
    ({"model": "some/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to method='ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "model": "some/draft", "num_speculative_tokens": 2}, "'model' is for method='draft_model'"),
    ("ngram", "must be a dict"),
])
def test_bad_config_names_the_key(bad, words):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.parse(bad)
    assert words in str(err.value)


def test_config_defaults_follow_vllm():
    assert SpeculativeConfig.parse({"num_speculative_tokens": 3}) == SpeculativeConfig(3, 5, 5)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 3, "prompt_lookup_max": 4}) == SpeculativeConfig(3, 4, 4)


def test_bad_config_refused_before_the_model_is_touched():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM("/definitely/not/a/model", speculative_config={"method": "ngram"})


def test_recurrent_models_are_refused():
    from hybrid_zoo import tiny_hybrid

    with pytest.raises(ValueError, match="cannot be rolled back"):
        LLM(tiny_hybrid("jamba"), speculative_config=NGRAM)


# ----------------------------------------------------------------------------- proposer
def test_ngram_index_proposes_after_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert index.propose(tokens, 2) == [7, 8]  # the latest earlier "1 2 3" is followed by 7 8
    assert index.propose(tokens + [5], 3) == []  # 5 never occurred before
    tokens += [7]
    assert index.propose(tokens, 4) == [8, 1, 2, 3]  # "2 3 7" ... the longest suffix wins
    assert NgramIndex(2, 2).propose([4, 4], 3) == []  # the suffix itself is not an earlier occurrence
    assert NgramIndex(1, 1).propose([4, 4], 3) == [4]  # the continuation stops at the end



def test_ngram_index_grows_one_entry_per_token():
    index, tokens = NgramIndex(2, 8), list(range(100)) * 3 + [0, 1, 2]
    assert index.propose(tokens, 4) == [3, 4, 5, 6]  # "... 0 1 2" seen twice before: the latest is used
    assert len(index.ends) == 100 and all(len(v) <= 4 for v in index.ends.values())
    tokens += [3]
    assert index.propose(tokens, 2) == [4, 5] and len(index.ends) == 100


# ----------------------------------------------------------------------------- greedy exactness
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_tiny_identical(tiny_pair, batch):
    base, spec = tiny_pair
    before = spec.stats()
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = base.generate(TEXTS[:batch], params, use_tqdm=False)
    got = spec.generate(TEXTS[:batch], params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    after = spec.stats()
    assert after.spec_accepted_tokens > before.spec_accepted_tokens
    assert after.spec_mean_acceptance_length > 1.0
    assert after.steps - before.steps < base.stats().steps  # fewer steps than tokens: speculation paid


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_engine_model_identical(batch):
    model = engine_model("llama")
    prompts = _copy_prompts(batch, seed=batch)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = LLM(model, num_blocks=256, block_size=8).generate(prompts, params, use_tqdm=False)
    spec = LLM(model, num_blocks=256, block_size=8, speculative_config=NGRAM, check_invariants=True)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert spec.stats().spec_proposed_tokens > 0


def test_max_tokens_never_exceeded_and_identical(tiny_pair):
    base, spec = tiny_pair
    for max_tokens in (1, 2, 3, 5, 7, 11):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        got = spec.generate(TEXTS[:4], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in got)
        assert _ids(got) == _ids(base.generate(TEXTS[:4], params, use_tqdm=False))


def test_stop_tokens_and_stop_strings_inside_accepted_tokens(tiny_pair):
    base, spec = tiny_pair
    free = base.generate(TEXTS[:4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    for out in free:
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        for params in (SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ids[12]]),
                       SamplingParams(max_tokens=40, temperature=0, stop=[text[len(text) // 2:len(text) // 2 + 4]])):
            want = base.generate([out.prompt], params, use_tqdm=False)[0].outputs[0]
            got = spec.generate([out.prompt], params, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            assert got.finish_reason == "stop"


def test_eos_inside_accepted_tokens(tiny_pair):
    """An EOS id met inside a run of accepted tokens ends the output there, as without speculation (the EOS
    set is swapped for a token these outputs repeat, so it is proposed and accepted)."""
    base, spec = tiny_pair
    free = spec.generate(TEXTS[:4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    saved = base.sampler.eos_token_ids, spec.sampler.eos_token_ids
    before = spec.stats().spec_accepted_tokens
    try:
        for out in free:
            ids = out.outputs[0].token_ids
            eos = max(ids, key=ids.index)  # the token that occurs first latest: accepted tokens come before it
            assert ids.index(eos) >= 8
            base.sampler.eos_token_ids = spec.sampler.eos_token_ids = frozenset({eos})
            params = SamplingParams(max_tokens=40, temperature=0)
            want = base.generate([out.prompt], params, use_tqdm=False)[0].outputs[0]
            got = spec.generate([out.prompt], params, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, "stop")
            assert got.token_ids[-1] == eos and eos not in got.token_ids[:-1]
        assert spec.stats().spec_accepted_tokens > before
    finally:
        base.sampler.eos_token_ids, spec.sampler.eos_token_ids = saved


# ----------------------------------------------------------------------------- sampling, n, logprobs
def test_seeded_samples_equal_no_speculation_alone_or_batched(tiny_pair):
    base, spec = tiny_pair
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=7, n=2),
              SamplingParams(max_tokens=32, top_p=0.9, seed=11),
              SamplingParams(max_tokens=32, temperature=0.7, top_k=20, seed=3, repetition_penalty=1.2)]
    want = base.generate(TEXTS[:3], params, use_tqdm=False)
    alone = [spec.generate([t], [p], use_tqdm=False)[0] for t, p in zip(TEXTS[:3], params, strict=True)]
    mixed = spec.generate(TEXTS[:3] + TEXTS[3:8], params + [SamplingParams(max_tokens=20)] * 5, use_tqdm=False)[:3]
    assert _ids(alone) == _ids(want)
    assert _ids(mixed) == _ids(want)
    assert len(want[0].outputs) == 2


def test_logprobs_are_the_target_models(tiny_pair):
    base, spec = tiny_pair
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True)
    want = base.generate(TEXTS[:3], params, use_tqdm=False)
    got = spec.generate(TEXTS[:3], params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            assert list(a.top) == list(b.top)


def test_structured_outputs_check_proposals_and_match(tiny_pair):
    """Grammar-constrained requests speculate (proposals cut to what the grammar accepts, every verified row
    masked) and give the outputs they give without speculation: greedy, and seeded sampling."""
    base, spec = tiny_pair
    regex = SamplingParams(max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(
        regex=r"(ab ){2,9}c"))
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                         "maxItems": 8}}, "required": ["items"],
              "additionalProperties": False}
    prompts = ["ab ab ab ab ab", '{"items": ["ab", "ab", "ab", "ab"]}\n{"items": ["ab", "ab",', "ab ab ab ab",
               '{"items": ["cd", "ab", "cd", "ab"]}\n']
    params = [regex, SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": schema}),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5, structured_outputs={"regex": r"(ab ){2,9}c"}),
              SamplingParams(max_tokens=60, temperature=0.8, seed=9, structured_outputs={"json": schema})]
    before = spec.stats()
    got = spec.generate(prompts, params, use_tqdm=False)
    want = base.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].text) for o in want]
    after = spec.stats()
    assert after.spec_accepted_tokens > before.spec_accepted_tokens


# ----------------------------------------------------------------------------- cache
def test_preemption_with_a_tiny_pool(tiny):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = LLM(*tiny).generate(TEXTS, params, use_tqdm=False)
    spec = LLM(*tiny, num_blocks=24, block_size=8, speculative_config=NGRAM, check_invariants=True)
    got = spec.generate(TEXTS, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    stats = spec.stats()
    assert stats.preemptions > 0 and stats.spec_accepted_tokens > 0


def _registered_prefixes(llm: LLM) -> list[tuple[int, ...]]:
    """The token prefix each prefix-cache key stands for (its block and all its parents)."""
    bm = llm.kv.blocks
    by_ident = {bm._blocks[bid].ident: bm._blocks[bid] for bid in bm._table.values()}
    out = []
    for bid in bm._table.values():
        block, tokens = bm._blocks[bid], []
        while block is not None:
            tokens[:0] = block.tokens
            block = by_ident.get(block.parent) if block.parent is not None else None
        out.append(tuple(tokens))
    return out


def test_rejected_tokens_never_stay_in_the_prefix_cache(tiny):
    spec = LLM(*tiny, block_size=4, speculative_config={**NGRAM, "num_speculative_tokens": 6},
               check_invariants=True)
    outs = spec.generate(TEXTS, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = spec.stats()
    assert stats.spec_proposed_tokens > stats.spec_accepted_tokens > 0  # some proposals were rejected
    finished = [tuple(o.prompt_token_ids + c.token_ids) for o in outs for c in o.outputs]
    prefixes = _registered_prefixes(spec)
    assert prefixes
    for prefix in prefixes:
        assert any(f[:len(prefix)] == prefix for f in finished), f"a cached block holds unaccepted tokens: {prefix}"


# ----------------------------------------------------------------------------- switch-offs
def test_disable_by_batch_size_and_low_acceptance_back_off(tiny_pair, tiny):
    base, _ = tiny_pair
    spec = LLM(*tiny, speculative_config={**NGRAM, "disable_by_batch_size": 4})
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert _ids(spec.generate(TEXTS[:4], params, use_tqdm=False)) == _ids(base.generate(TEXTS[:4], params,
                                                                                       use_tqdm=False))
    assert spec.stats().spec_verifications == 0
    spec.generate(TEXTS[:3], params, use_tqdm=False)
    assert spec.stats().spec_verifications > 0
    torch.manual_seed(0)
    hot = LLM(*tiny, speculative_config=NGRAM)
    hot.generate(["a b c d e f g h i j"], SamplingParams(max_tokens=64, temperature=2.0, ignore_eos=True),
                 use_tqdm=False)
    s = hot.stats()
    assert s.spec_verifications < 32  # rejected proposals back off: far fewer verifications than steps


def _running_seq(tokens: list[int], num_prompt: int) -> Seq:
    """A running decode sequence (its last token not computed yet) of a one-sample request."""
    group = Group("r", None, tokens[:num_prompt], SamplingParams(max_tokens=100), RequestMetrics(0.0),
                  max_total_tokens=1000)
    seq = group.new_seq(0, tokens)
    seq.num_computed = len(tokens) - 1
    return seq


def test_proposal_length_follows_the_acceptance_rate_and_the_batch_size():
    assert worth_proposing(0.8, 0.5, 4) == 3  # 0.8 ** 3 >= 0.5 > 0.8 ** 4
    assert worth_proposing(0.3, 0.5, 4) == 0 and worth_proposing(1.0, 0.9, 4) == 4
    pattern = [5, 6, 7, 8] * 6
    spec = Speculator(SpeculativeConfig(4, 3, 1))
    assert list(spec.propose([_running_seq(pattern, 8)]).values()) == [[5, 6, 7, 8]]  # alone: all k at rate 1/2
    assert list(spec.propose([_running_seq(pattern + [5, 6], 8)]).values()) == [[7, 8, 5, 6]]
    spec.counters.recent_tried = 1000.0  # the recent rate drops to ~0: a batch of 32 gets proposals only
    batch = [_running_seq(pattern, 8) for _ in range(32)]  # every 4 * PROBE_PERIOD-th step (32 // 8 = 4)
    spec.steps = 0
    rounds = [bool(spec.propose(batch)) for _ in range(8 * PROBE_PERIOD)]
    assert sum(rounds) == 2 and rounds[4 * PROBE_PERIOD - 1]


# ----------------------------------------------------------------------------- failures
def test_failed_verification_step_leaves_a_consistent_cache(tiny_pair, monkeypatch):
    """A forward that fails in a verification step, and a verifier that fails after the forward: the step's
    slots and proposed tokens are given back, and the requests then finish as without speculation."""
    import flashpage.engine.llm as llm_module

    base, spec = tiny_pair
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = _ids(base.generate(TEXTS[:4], params, use_tqdm=False))
    calls = {"n": 0}

    def failing_verify(*args, **kwargs):
        calls["n"] += 1
        raise RuntimeError("injected verifier fault")

    for rid in ("a", "b", "c", "d"):
        spec.add_request(TEXTS["abcd".index(rid)], params, request_id=rid)
    for _ in range(6):  # into decoding, with proposals
        spec.step()
    monkeypatch.setattr(llm_module, "verify", failing_verify)
    with pytest.raises(RuntimeError, match="injected verifier fault"):
        while calls["n"] == 0:
            spec.step()
    monkeypatch.undo()
    spec.kv.blocks.check_invariants()
    hook = spec.model.model.layers[0].register_forward_pre_hook(_fail_on_multi_token_input())
    try:
        with pytest.raises(RuntimeError, match="injected forward fault"):
            while spec.has_unfinished_requests():
                spec.step()
    finally:
        hook.remove()
    spec.kv.blocks.check_invariants()
    done = {}
    while spec.has_unfinished_requests():
        for out in spec.step():
            if out.finished:
                done[out.request_id] = out
    assert [[done[r].outputs[0].token_ids] for r in "abcd"] == want


def _fail_on_multi_token_input():
    """A forward pre-hook raising once on a step whose input has a verification chunk among one-token decodes
    (more tokens than sequences, every one of them decoding)."""
    state = {"armed": True}

    def hook(module, args, kwargs=None):
        hidden = args[0] if args else None
        if state["armed"] and hidden is not None and 4 < hidden.shape[1] <= 4 * 5:
            state["armed"] = False
            raise RuntimeError("injected forward fault")

    return hook


def test_verification_chunks_mixed_with_prefill_chunks(tiny_pair):
    """Requests arriving while others speculate: their prompt chunks share steps with verification chunks
    (a small token budget chunks the prompts); outputs as without speculation."""
    _, spec = tiny_pair
    model, tok = spec.model, spec.tokenizer
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = []
    for cfg in (None, NGRAM):
        llm = LLM(model, tok, max_num_batched_tokens=24, speculative_config=cfg, check_invariants=True)
        done, mixed = {}, 0
        run = llm.runner.run

        def counting_run(schedule, extra_rows=(), _run=run):
            nonlocal mixed
            chunks = schedule.chunks
            mixed += any(c.draft for c in chunks) and any(not c.draft and c.num_tokens > 1 for c in chunks)
            return _run(schedule, extra_rows)

        llm.runner.run = counting_run
        for i, text in enumerate(TEXTS):
            llm.add_request(text, params, request_id=str(i))
            for _ in range(3):
                for out in llm.step():
                    done[out.request_id] = out
        while llm.has_unfinished_requests():
            for out in llm.step():
                done[out.request_id] = out
        results.append([done[str(i)].outputs[0].token_ids for i in range(len(TEXTS))])
        if cfg is not None:
            assert mixed > 0 and llm.stats().spec_accepted_tokens > 0
    assert results[0] == results[1]


def test_tensor_parallel_is_supported_but_a_sharded_draft_is_refused():
    """n-gram and whole draft models run under TP (tests/engine/test_tp.py); a draft object sharded with tp_plan
    is refused before anything is built; the digest-and-agree helpers keep rank 0's verdicts."""
    from types import SimpleNamespace

    from flashpage.engine.spec import check_spec_support
    from flashpage.engine.spec_verify import Verdict, agree

    check_spec_support(SpeculativeConfig(2, 2, 2), object(), recurrent=False, tensor_parallel=True)
    sharded = SimpleNamespace(_tp_size=2)
    config = SpeculativeConfig(2, 0, 0, method="draft_model", model=sharded)
    with pytest.raises(ValueError, match="sharded over 2 ranks.*load it without tp_plan"):
        check_spec_support(config, object(), recurrent=False, tensor_parallel=True)
    mine = [Verdict([5, 6], 1, [0, 1]), Verdict([9], 0, [3])]
    rank0 = [5, 6, 7, 4, -1]  # rank 0 kept all three of the first proposal, and the second's correction 4
    sent: list[list[int]] = []
    got = agree(mine, [[5, 6], [8]], lambda flat: sent.append(flat) or rank0)
    assert sent == [[5, 6, -1, 9, -1]]  # padded: the same length on every rank
    assert [(v.tokens, v.accepted, v.rows) for v in got] == [([5, 6, 7], 2, [0, 1, 2]), ([4], 0, [3])]
    # a draft model's proposals: rank 0's, in the order of the sequences asked (one this rank had none for)
    from flashpage.engine.spec import _agreed

    asked: list[list[list[int]]] = []
    assert _agreed({1: [5]}, [1, 2], lambda lists: asked.append(lists) or [[7], [8, 9]]) == {1: [7], 2: [8, 9]}
    assert asked == [[[5], []]]
    assert _agreed({1: [5]}, [1, 2], lambda lists: [[7]]) == {1: [5]}  # ranks asked differently: the digest stops
