"""flashpage.LLM on models only generate()'s layout is exact on (engine/solo.py): sparse-attention indexers
(DeepSeek-V3.2's DSA kind: deepseek_v32, glm_moe_dsa; Qwen4-Exp's QSA indexer, whose selection lives in the mask)
and models that edit their attention mask (Doge's dynamic bias).

Oracle: the sweep's tiny float32 models, unpatched ``generate()`` one request at a time, greedy: tokens identical
and every returned logprob (the token's and the top ones') within 1e-4 of the unpatched log-softmax. Several
requests of different lengths added together (decodes of several sequences share a step, each in its own
forward), a pool too small for all of them (preempted and recomputed: the prompt whole, then the outputs one at a
time), a prompt over ``max_num_batched_tokens`` refused when added, images (Mistral-Large-4, Qwen4-Exp). Without
the solo steps the packed step cannot run them at all (shown), and the scheduler's generate() layout is checked
on its own.
"""

from __future__ import annotations

import itertools
from functools import cache

import pytest
import torch
from sweep_configs import VOCAB
from sweep_models import build_model

import flashpage
from flashpage import LLM, SamplingParams
from flashpage.cache import PagedKVCache
from flashpage.engine import llm as llm_module
from flashpage.engine import multimodal
from flashpage.engine.outputs import RequestMetrics
from flashpage.engine.scheduler import Scheduler
from flashpage.engine.sequence import Group

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")

ATOL = 1e-4
MAX_NEW = 10
LENGTHS = (9, 5, 13, 3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, ignore_eos=True)
TYPES = ["deepseek_v32", "glm_moe_dsa", "qwen4_exp_text", "qwen4_exp", "doge"]
Reference = tuple[list[int], list[torch.Tensor]]  # new tokens, per-step log-softmax


def _prompts(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(VOCAB, 99), (n,), generator=g).tolist() for n in lengths]


@cache
def _model(model_type: str) -> torch.nn.Module:
    model = build_model(model_type)
    if model_type == "doge":  # A = 0 at init makes its dynamic bias a constant (softmax-invariant): perturb it
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.normal_(0, 1.0)
    return model


def _oracle(model: torch.nn.Module, prompt: list[int], max_new: int = MAX_NEW) -> Reference:
    """Unpatched generate() on one request: (new tokens, per-step log-softmax)."""
    assert not flashpage.is_patched(model)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [x[0].float().log_softmax(-1) for x in out.logits]


def _assert_exact(output, ref: Reference) -> None:
    comp = output.outputs[0]
    assert comp.token_ids == ref[0]
    worst = 0.0
    for step, lp in enumerate(comp.logprobs):
        worst = max(worst, abs(lp.logprob - float(ref[1][step][lp.token_id])),
                    *(abs(v - float(ref[1][step][t])) for t, v in lp.top.items()))
    assert worst <= ATOL, worst


def _generate(model: torch.nn.Module, prompts: list, refs: list[Reference], **options) -> LLM:
    llm = LLM(model, block_size=4, max_num_seqs=4, compile=False, check_invariants=True, **options)
    try:
        assert llm.solo_reason is not None
        assert not llm.stats().prefix_caching  # a prompt computed from a cached block on is not generate()'s
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            _assert_exact(out, ref)
    finally:
        flashpage.unpatch(model)
    return llm


def _refs(model: torch.nn.Module, prompts: list[list[int]]) -> list[Reference]:
    return [_oracle(model, p) for p in prompts]


# ----------------------------------------------------------------------------------------- text requests
@pytest.mark.parametrize("model_type", TYPES)
def test_requests_added_together_equal_generate_one_at_a_time(model_type: str) -> None:
    """Four prompts of different lengths in one LLM: each prompt whole in one forward, then the decodes of all
    four in each step (one forward each): tokens identical, logprobs within 1e-4."""
    model = _model(model_type)
    prompts = _prompts()
    llm = _generate(model, prompts, _refs(model, prompts), num_blocks=64)
    stats = llm.stats()
    assert stats.steps < len(prompts) * MAX_NEW  # sequences share steps (each in its own forward)
    assert stats.preemptions == 0


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "qwen4_exp_text", "doge"])
def test_preempted_requests_recompute_exactly(model_type: str) -> None:
    """A pool of 9 blocks of 4 for four requests of up to 23 tokens: some are preempted and recomputed (the prompt
    in one forward, then each output token in its own, as generate() computed them; Qwen4-Exp's recurrent states
    start over)."""
    model = _model(model_type)
    prompts = _prompts()
    llm = _generate(model, prompts, _refs(model, prompts), num_blocks=9)
    assert llm.stats().preemptions > 0


@pytest.mark.parametrize("model_type", ["deepseek_v32", "qwen4_exp_text"])
def test_prompt_over_the_budget_refused_at_add(model_type: str) -> None:
    """A prompt is computed whole in one step: one longer than max_num_batched_tokens is refused when added, naming
    the setting; one that fits the budget exactly runs, exact."""
    model = _model(model_type)
    long, fits = _prompts((9, 8), seed=3)
    llm = LLM(model, block_size=4, num_blocks=64, max_num_batched_tokens=8, compile=False)
    try:
        with pytest.raises(ValueError, match=r"prompt has 9 tokens .* max_num_batched_tokens=8"):
            llm.add_request(long, GREEDY)
        assert not llm.has_unfinished_requests()
        out = llm.generate([fits], GREEDY, use_tqdm=False)
    finally:
        flashpage.unpatch(model)
    _assert_exact(out[0], _oracle(model, fits))


@pytest.mark.parametrize("model_type", ["deepseek_v32", "qwen4_exp_text"])
def test_prompt_logprobs_in_solo_steps(model_type: str) -> None:
    """Prompt logprobs (rows of the prompt's own forward, kept beside the emitting rows of the step's other
    sequences) equal the unpatched model's plain forward; the outputs stay exact."""
    from test_prompt_logprobs import _check

    model = _model(model_type)
    prompts = _prompts((9, 6), seed=5)
    refs = _refs(model, prompts)
    asks = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, ignore_eos=True, prompt_logprobs=2)
    llm = LLM(model, block_size=4, num_blocks=64, compile=False)
    try:
        outs = llm.generate(prompts, [asks, GREEDY], use_tqdm=False)
    finally:
        flashpage.unpatch(model)
    for out, ref in zip(outs, refs, strict=True):
        _assert_exact(out, ref)
    _check(model, outs[0], 2)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "qwen4_exp_text"])
def test_a_forward_failing_mid_step_is_rolled_back(model_type: str) -> None:
    """An exception in the third sequence's forward of a decode step (two forwards of the step already ran): the
    step is rolled back (pages; recurrent states start over), the error reaches step(), and the requests then
    finish exact."""
    model = _model(model_type)
    prompts = _prompts()
    refs = _refs(model, prompts)
    llm = LLM(model, block_size=4, num_blocks=64, compile=False, check_invariants=True)
    calls = {"n": 0}

    def fail_once(module: torch.nn.Module, args: tuple) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")

    try:
        ids = [llm.add_request(p, GREEDY) for p in prompts]
        while llm.scheduler.waiting:  # every prompt computed: the next steps decode all four
            llm.step()
        handle = model.model.layers[-1].register_forward_pre_hook(fail_once)
        try:
            with pytest.raises(RuntimeError, match="injected fault"):
                llm.step()
        finally:
            handle.remove()
        done: dict[str, object] = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o for o in llm.step() if o.finished})
    finally:
        flashpage.unpatch(model)
    for rid, ref in zip(ids, refs, strict=True):
        _assert_exact(done[rid], ref)


def test_speculative_decoding_is_refused() -> None:
    """A verification chunk (a decode plus proposed tokens) is not generate()'s layout: refused up front."""
    model = _model("deepseek_v32")
    with pytest.raises(ValueError, match="speculative_config: .* one sequence per forward"):
        LLM(model, block_size=4, num_blocks=64, compile=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not flashpage.is_patched(model)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "doge"])
def test_packed_steps_cannot_run_them(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The solo steps are what makes these models run: with them off (the model taken as any other, packed
    [1, T] steps), the step fails before any token (the indexer's keys have no place in a packed step; Doge's
    edited mask is the padded batch's, not the step's) instead of answering. (Not Qwen4-Exp here: the packed
    path installs the engine's fused rotary, whose signature its indexer's query-only call does not fit.)"""
    model = _model(model_type)
    monkeypatch.setattr(llm_module, "generate_layout_reason", lambda report: None)
    llm = LLM(model, block_size=4, num_blocks=64, compile=False)
    try:
        assert llm.solo_reason is None
        with pytest.raises(RuntimeError, match="update_indexer|size of tensor"):
            llm.generate(_prompts()[:2], GREEDY, use_tqdm=False)
    finally:
        flashpage.unpatch(model)


def test_a_prompt_cut_into_chunks_is_not_exact() -> None:
    """Why a prompt is computed whole: the same solo forwards with the prompts chunked (3 tokens a step, the
    scheduler's generate() layout off) drift past 1e-4 in logprobs on DeepSeek-V3.2 (measured: ~1e-3), silently."""
    model = _model("deepseek_v32")
    prompts = _prompts((9, 5, 13, 3, 17, 11), seed=1)
    refs = _refs(model, prompts)
    llm = LLM(model, block_size=4, num_blocks=64, compile=False)
    try:
        llm.scheduler.generate_layout = False  # the scheduler alone back to chunked prefill
        llm.scheduler.max_num_batched_tokens = 3
        llm.solo_reason = None  # (the refusal at add time, off)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        flashpage.unpatch(model)
    with pytest.raises(AssertionError):
        for out, ref in zip(outs, refs, strict=True):
            _assert_exact(out, ref)


# -------------------------------------------------------------------------------------------------- images
@pytest.mark.parametrize("model_type", ["mistral_large4", "qwen4_exp"])
def test_image_requests_equal_generate(model_type: str) -> None:
    """The sweep's image inputs (two images, two prompts each) and a text request, in a pool that preempts: exact.
    Qwen4-Exp's M-RoPE positions are the request's own, its indexer's recorded positions rebuilt per forward."""
    from test_llm_images import GREEDY as IMAGE_GREEDY
    from test_llm_images import _assert_exact as assert_image_exact
    from test_llm_images import _case_requests, _image_case
    from test_llm_images import _oracle as image_oracle

    assert model_type in multimodal.IMAGE_TYPES  # images in LLM are opened per model type (engine/multimodal.py)
    case = _image_case(model_type)
    model = case.model
    reqs, refs = _case_requests(case)
    text = reqs[0]["prompt_token_ids"][:3]
    refs.append(image_oracle(model, {"input_ids": torch.tensor([text])}))
    llm = LLM(model, block_size=2, num_blocks=20, max_model_len=40, max_num_batched_tokens=64,
              check_invariants=True)
    try:
        assert llm.solo_reason is not None
        outs = llm.generate(reqs + [text], IMAGE_GREEDY, use_tqdm=False)
        assert llm.stats().preemptions > 0
        for out, ref in zip(outs, refs, strict=True):
            assert_image_exact(out, ref)
    finally:
        flashpage.unpatch(model)


# ----------------------------------------------------------------------------- the scheduler's constraint
_rid = itertools.count()


def _scheduler(generate_layout: bool, num_blocks: int = 32, budget: int = 10) -> Scheduler:
    kv = PagedKVCache(1, 1, 4, num_blocks=num_blocks, block_size=4, enable_prefix_caching=False)
    return Scheduler(kv, 8, budget, generate_layout=generate_layout)


def _add(sched: Scheduler, n: int):
    group = Group(f"r{next(_rid)}", None, list(range(3, 3 + n)), SamplingParams(max_tokens=100), RequestMetrics(0.0))
    seq = group.new_seq(0, list(range(3, 3 + n)))
    sched.add(seq)
    return seq


def _step(sched: Scheduler) -> list[tuple[int, int, int]]:
    """One simulated step: (sequence, start, tokens) per chunk; emitting chunks append a token."""
    schedule = sched.schedule()
    for chunk in schedule.chunks:
        chunk.seq.num_computed += chunk.num_tokens
        if chunk.emits:
            chunk.seq.token_ids.append(7)
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in schedule.chunks]


@pytest.mark.parametrize("generate_layout", [False, True])
def test_scheduler_cuts_chunks_as_generate_computes_tokens(generate_layout: bool) -> None:
    """generate_layout: a prompt whole or not this step (never chunked), then one token per chunk; a preempted
    sequence recomputes its prompt whole, then its outputs one at a time. Without it: chunked prefill, and a
    recompute of prompt and outputs in one chunk."""
    sched = _scheduler(generate_layout)
    a, b = _add(sched, 8), _add(sched, 8)
    first = _step(sched)
    assert first == ([(a.seq_id, 0, 8)] if generate_layout else [(a.seq_id, 0, 8), (b.seq_id, 0, 2)])
    for _ in range(3):
        _step(sched)
    # a has 8 + 4 tokens: preempt it by hand and see how it is recomputed
    sched.running.remove(a)
    sched._release(a)
    a.num_computed = 0
    sched.waiting.appendleft(a)
    sched.max_num_batched_tokens = sched.max_prefill_with_decodes = 64
    chunks = [c for c in _step(sched) if c[0] == a.seq_id]
    assert chunks == ([(a.seq_id, 0, 8)] if generate_layout else [(a.seq_id, 0, 12)])
    if generate_layout:
        replay: list[tuple[int, int, int]] = []
        for _ in range(3):
            replay += [c for c in _step(sched) if c[0] == a.seq_id]
        assert replay == [(a.seq_id, 8, 1), (a.seq_id, 9, 1), (a.seq_id, 10, 1)]


def test_scheduler_generate_layout_ignores_proposals() -> None:
    """A decode never carries proposed tokens in generate()'s layout."""
    sched = _scheduler(True)
    a = _add(sched, 4)
    _step(sched)
    schedule = sched.schedule({a.seq_id: [5, 6]})
    assert [(c.num_tokens, c.draft) for c in schedule.chunks] == [(1, [])]
