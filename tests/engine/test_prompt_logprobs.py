"""``SamplingParams(prompt_logprobs=k)`` equals transformers' log-softmax of a plain forward (within
1e-5, float32) at every prompt position: whole prefills, chunked prefills, prompts whose prefix is in
the prefix cache, preempted and resumed requests, n > 1, mixed with requests that did not ask.
Also the context-length limit of the offline LLM (ValueError, or truncation when opted in).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import VOCAB, engine_model, random_prompts

from flashpage import LLM, SamplingParams
from flashpage.engine import RequestOutput
from flashpage.patches import is_patched, unpatch

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5


def _reference(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, V) log-softmax of the unpatched model's plain forward, row i predicting token i + 1."""
    if is_patched(model):
        unpatch(model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _check(model: torch.nn.Module, out: RequestOutput, k: int) -> None:
    prompt = out.prompt_token_ids
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    ref = _reference(model, prompt)
    for i, entry in enumerate(lps[1:]):
        assert entry is not None and entry.token_id == prompt[i + 1]
        want = float(ref[i, prompt[i + 1]])
        assert abs(entry.logprob - want) <= TOL, f"position {i + 1}: {entry.logprob} vs {want}"
        assert len(entry.top) == k
        vals, ids = ref[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        got = sorted(entry.top.items(), key=lambda kv: -kv[1])
        for (tid, v), want_v, want_id in zip(got, vals.tolist(), ids.tolist(), strict=True):
            assert abs(v - want_v) <= TOL
            assert abs(float(ref[i, tid]) - v) <= TOL  # the id carries that value (ids may swap on a tie)
            if tid != want_id:
                assert abs(float(ref[i, want_id]) - want_v) <= TOL


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = engine_model()
    yield m
    unpatch(m)


@pytest.mark.parametrize("budget", [2048, 7])
def test_prompt_logprobs_equal_a_plain_forward(model: torch.nn.Module, budget: int) -> None:
    """Whole prefills (budget 2048) and prefills chunked into 7-token pieces across steps, batched with
    requests that do not ask (their outputs are as without), n > 1, k = 0 and k = 5."""
    llm = LLM(model, block_size=8, num_blocks=128, max_num_batched_tokens=budget, check_invariants=True)
    prompts = random_prompts(6, 1, 40, seed=1)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    asks = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=k, n=n)
            for k, n in ((5, 1), (0, 1), (2, 3))]
    params = [asks[0], plain, asks[1], asks[2], plain, asks[0]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    for out, p, ref in zip(outs, params, alone, strict=True):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            _check(model, out, p.prompt_logprobs)
        assert out.outputs[0].token_ids == ref.token_ids  # asking changes nothing else
    assert len(outs[3].outputs) == 3


def test_prefix_cache_hits_still_yield_prompt_logprobs(model: torch.nn.Module) -> None:
    """A prompt whose prefix blocks are cached is computed in full for the request that asks (and
    only for it): its logprobs cover the cached prefix too."""
    llm = LLM(model, block_size=8, num_blocks=128, check_invariants=True)
    shared = random_prompts(1, 33, 33, seed=2)[0]
    prompts = [shared + [5, 6, 7], shared + [9, 10]]
    llm.generate([shared + [11]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    hit = llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert hit.metrics.cached_prompt_tokens == 32  # the cache is warm for this prefix
    asked = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1),
                         use_tqdm=False)
    for out in asked:
        assert out.metrics.cached_prompt_tokens == 0
        _check(model, out, 1)
    assert asked[0].token_ids == hit.token_ids


def test_preempted_requests_keep_their_prompt_logprobs(model: torch.nn.Module) -> None:
    """A pool too small for every request at once preempts (recompute) some, mid-prefill or after it:
    each prompt logprob is still recorded exactly once, with the right value."""
    llm = LLM(model, block_size=4, num_blocks=40, max_num_batched_tokens=16, max_prefill_with_decodes=16,
              max_model_len=160, check_invariants=True)
    prompts = random_prompts(6, 20, 36, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().preemptions > 0
    for out in outs:
        _check(model, out, 3)


def test_streamed_and_stepped_requests_report_prompt_logprobs(model: torch.nn.Module) -> None:
    """add_request/step: the entries grow in order while a chunked prompt is computed; the final output
    has them all."""
    llm = LLM(model, block_size=8, num_blocks=64, max_num_batched_tokens=8)
    prompt = random_prompts(1, 30, 30, seed=4)[0]
    rid = llm.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    seen: list[int] = []
    last = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == rid:
                seen.append(len(out.prompt_logprobs or ()))
                last = out
    assert last is not None and last.finished
    assert seen[-1] == len(prompt) and seen == sorted(seen)
    _check(model, last, 0)


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_prompt_logprobs_out_of_range(bad: object) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- context length
def test_max_tokens_beyond_the_context_is_refused(model: torch.nn.Module) -> None:
    """prompt + max_tokens > max_model_len: ValueError naming both numbers, nothing queued; opted in,
    a warning says how much will be generated and the output stops there with "length"."""
    llm = LLM(model, block_size=8, num_blocks=64, max_model_len=64)
    prompt = [int(t) for t in torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(5))]
    with pytest.raises(ValueError, match=r"maximum context length \(max_model_len\) is 64 tokens.*requested 70 tokens "
                                         r"\(60 in the prompt, 10 in max_tokens\).*at most 4.*truncate_max_tokens"):
        llm.generate([prompt], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match=r"2\*\*63|9223372036854775868 tokens"):
        llm.add_request(prompt, SamplingParams(max_tokens=2**63))
    assert not llm.has_unfinished_requests()
    fits = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(fits[0].token_ids) == 4
    with pytest.warns(UserWarning, match=r"truncate_max_tokens=True: generating at most 4 tokens"):
        cut = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                    truncate_max_tokens=True), use_tqdm=False)
    assert cut[0].token_ids == fits[0].token_ids and cut[0].finish_reason == "length"
