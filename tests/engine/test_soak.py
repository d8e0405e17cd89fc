"""Soak: many random requests arriving while steps run, on a KV pool small enough to preempt and evict.

One scenario, two sizes: 150 requests in the default run, 2000 with ``pytest -m soak`` (or
``FLASHPAGE_SOAK=1``; otherwise the long case is skipped, so a plain ``pytest`` stays fast without a
conftest hook). The test drives ``add_request``/``step``/``abort`` itself, adding a few random
requests between steps (prompt lengths 1..80, half of them on shared prefixes so the prefix cache
hits and evicts; random SamplingParams: greedy, seeded and unseeded sampling with temperature,
top-k/p, min-p, penalties, n, stop ids, stop strings, min_tokens, logprobs), aborts random running
or waiting requests, and every few waves consumes a few requests through ``LLM.stream`` while the
others stay queued (and checks that those progress meanwhile).

At the end: every request finished or was aborted exactly once (no output after its abort, no
output ever rewritten); every output is well formed for its parameters; every greedy and seeded
output equals a reference run of the same requests on a roomy pool (greedy: tie-aware, with equal
log-probabilities); a random sample also equals transformers' generate(); streams concatenate to
their request's final token ids and text; the block invariant held after every step
(``check_invariants=True``) and every block is back. The figures are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from engine_helpers import engine_model, hf_greedy
from reliability_helpers import GroupRecorder, assert_logprobs_close, assert_pool_clean, check_greedy

from flashpage import LLM, RequestOutput, SamplingParams
from flashpage.patches import unpatch
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

try:
    from model_zoo import tiny_tokenizer
except ImportError:  # pragma: no cover - older model_zoo: run without text
    tiny_tokenizer = None

VOCAB = 128
SHORT, FULL = 150, 2000
SOAK_ENV = "FLASHPAGE_SOAK"
POOL = dict(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=16)
STREAM_EVERY = 20  # waves between two stream() calls
ABORT_P = 0.04  # chance per wave of aborting a random live request
MAX_PROMPT = 80
ARRIVALS = [0, 0, 0, 1, 1]  # new requests per wave: a little under what the pool serves, so a queue forms


@dataclass
class Spec:
    """One request of the soak: what was asked and how it is driven."""

    prompt: list[int]
    params: SamplingParams
    kind: str  # "greedy", "seeded" or "sampled"
    mode: str  # "step" (add_request + step) or "stream"
    request_id: str = ""


@dataclass
class Ledger:
    """Everything the soak observed, per request id."""

    specs: dict[str, Spec] = field(default_factory=dict)
    reports: dict[str, list[RequestOutput]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, RequestOutput] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    abort_reports: dict[str, RequestOutput] = field(default_factory=dict)
    streamed: dict[str, RequestOutput] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)

    def record(self, out: RequestOutput) -> None:
        rid = out.request_id
        assert rid in self.specs, f"step() reported unknown request {rid!r}"
        if rid in self.aborted:  # reported once more, by the next step(), as aborted
            assert rid not in self.abort_reports, f"request {rid} was reported twice after it was aborted"
            assert out.finished and "abort" in {c.finish_reason for c in out.outputs}
            self.abort_reports[rid] = out
            return
        assert rid not in self.finished, f"request {rid} was reported again after it had finished"
        previous = self.reports[rid][-1] if self.reports[rid] else None
        if previous is not None:
            for old, new in zip(previous.outputs, out.outputs, strict=True):
                assert new.token_ids[: len(old.token_ids)] == old.token_ids, f"request {rid}: output rewritten"
        self.reports[rid].append(out)
        if out.finished:
            self.finished[rid] = out
            self.live.discard(rid)


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def model() -> Iterator[torch.nn.Module]:
    m = engine_model()
    yield m
    unpatch(m)


def _long_run_selected(config: pytest.Config) -> bool:
    markexpr = config.getoption("markexpr", "") or ""
    return os.environ.get(SOAK_ENV) == "1" or ("soak" in markexpr and "not soak" not in markexpr)


# ------------------------------------------------------------------------------- random requests
def _random_params(rng: random.Random, kind: str, tokenizer: Any) -> SamplingParams:
    max_tokens = rng.randint(1, 20)
    kw: dict[str, Any] = {"max_tokens": max_tokens, "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.25:
        kw["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.25:
        kw["stop_token_ids"] = rng.sample(range(3, VOCAB), rng.randint(1, 4))
    if rng.random() < 0.3:
        kw["ignore_eos"] = True
    if rng.random() < 0.5:
        kw["logprobs"] = rng.choice([0, 1, 3])
    if tokenizer is not None and rng.random() < 0.15:
        kw["stop"] = [tokenizer.decode([rng.randint(3, VOCAB - 1)]) for _ in range(rng.randint(1, 3))]
    if kind == "greedy":
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=round(rng.uniform(0.2, 1.5), 3), top_k=rng.choice([0, -1, 1, 5, 40]),
                  top_p=rng.choice([1.0, 0.95, 0.7, 0.3]), min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
                  repetition_penalty=rng.choice([1.0, 1.0, 1.2, 0.9]),
                  presence_penalty=rng.choice([0.0, 0.5, -0.5]), frequency_penalty=rng.choice([0.0, 0.3, -0.3]))
        if kind == "seeded":
            kw["seed"] = rng.randint(0, 10**6)
    return SamplingParams(**kw)


def _random_specs(rng: random.Random, n: int, tokenizer: Any) -> list[Spec]:
    prefixes = [[rng.randint(3, VOCAB - 1) for _ in range(rng.randint(4, 40))] for _ in range(6)]
    specs: list[Spec] = []
    for _ in range(n):
        if specs and rng.random() < 0.05:  # an exact repeat of an earlier prompt
            prompt = list(rng.choice(specs).prompt)
        elif rng.random() < 0.5:
            prefix = rng.choice(prefixes)
            body = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(0, MAX_PROMPT - len(prefix)))]
            prompt = prefix + body
        else:
            prompt = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, MAX_PROMPT))]
        kind = rng.choices(["greedy", "seeded", "sampled"], weights=[50, 25, 25])[0]
        mode = "stream" if rng.random() < 0.08 else "step"
        specs.append(Spec(prompt, _random_params(rng, kind, tokenizer), kind, mode))
    return specs


# ----------------------------------------------------------------------------------- driver
class Soak:
    """Drives one LLM through the random specs and records what happened."""

    def __init__(self, llm: LLM, specs: list[Spec], rng: random.Random) -> None:
        self.llm = llm
        self.rng = rng
        self.recorder = GroupRecorder(llm)
        self.ledger = Ledger()
        self.step_queue = deque(s for s in specs if s.mode == "step")
        self.stream_queue = deque(s for s in specs if s.mode == "stream")
        self.peak_blocks = 0
        self.streams = 0
        self.stream_progress = 0
        self.waves = 0

    def _observe(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.llm.stats().blocks_used)

    def run(self, max_waves: int) -> None:
        llm, rng, ledger = self.llm, self.rng, self.ledger
        while self.step_queue or self.stream_queue or llm.has_unfinished_requests():
            self.waves += 1
            assert self.waves <= max_waves, "the soak made no progress"
            for _ in range(rng.choice(ARRIVALS)):
                if self.step_queue:
                    spec = self.step_queue.popleft()
                    spec.request_id = llm.add_request(spec.prompt, spec.params)
                    ledger.specs[spec.request_id] = spec
                    ledger.live.add(spec.request_id)
            drained = not self.step_queue and not ledger.live
            if self.stream_queue and (self.waves % STREAM_EVERY == 0 or drained):
                self._stream(rng.randint(1, 3))
            live = sorted(r for r in ledger.live if not self.recorder.groups[r].finished)  # not done inside a stream
            if live and rng.random() < ABORT_P:
                rid = rng.choice(live)
                llm.abort(rid)
                ledger.aborted.add(rid)
                ledger.live.discard(rid)
            for out in llm.step():
                ledger.record(out)
            self._observe()

    def _stream(self, k: int) -> None:
        llm, ledger, rec = self.llm, self.ledger, self.recorder
        batch = [self.stream_queue.popleft() for _ in range(min(k, len(self.stream_queue)))]
        queued = {rid: rec.num_output(rid) for rid in ledger.live}
        known = set(rec.groups)
        ids: dict[tuple[str, int], list[int]] = defaultdict(list)
        text: dict[tuple[str, int], str] = defaultdict(str)
        reasons: dict[tuple[str, int], str | None] = {}
        for delta in llm.stream([s.prompt for s in batch], [s.params for s in batch]):
            key = (delta.request_id, delta.index)
            assert key not in reasons, f"stream output for sample {key} after it had finished"
            ids[key].extend(delta.token_ids)
            text[key] += delta.text
            if delta.finished:
                reasons[key] = delta.finish_reason
            self._observe()
        self.streams += 1
        new = [rid for rid in rec.groups if rid not in known]
        assert len(new) == len(batch)
        for rid, spec in zip(new, batch, strict=True):
            spec.request_id = rid
            ledger.specs[rid] = spec
            final = rec.groups[rid].to_output()
            assert final.finished
            ledger.streamed[rid] = final
            for c in final.outputs:
                key = (rid, c.index)
                assert ids[key] == c.token_ids, f"stream {key}: concatenated ids {ids[key]} != final {c.token_ids}"
                assert reasons.get(key) == c.finish_reason, f"stream {key} ended with {reasons.get(key)}"
                if llm.tokenizer is not None:
                    assert text[key] == c.text, f"stream {key}: text {text[key]!r} != final {c.text!r}"
        # the queued requests progressed meanwhile; those that finished are reported by the next step()
        self.stream_progress += sum(rec.num_output(rid) - n for rid, n in queued.items())


# ---------------------------------------------------------------------------------- checks
def _check_well_formed(spec: Spec, out: RequestOutput, eos: frozenset[int], max_model_len: int) -> None:
    p = spec.params
    assert out.prompt_token_ids == spec.prompt
    assert [c.index for c in out.outputs] == list(range(p.n))
    stops = set(p.stop_ids) | (set() if p.ignore_eos else set(eos))
    for c in out.outputs:
        toks = c.token_ids
        assert 1 <= len(toks) <= p.max_tokens, f"{len(toks)} tokens for max_tokens={p.max_tokens}"
        assert all(0 <= t < VOCAB for t in toks)
        assert not stops & set(toks[: p.min_tokens]), f"a stop/EOS token within min_tokens={p.min_tokens}"
        assert not stops & set(toks[p.min_tokens:-1]), "output continued past a stop/EOS token"
        if c.finish_reason == "length":
            assert len(toks) == p.max_tokens or len(spec.prompt) + len(toks) >= max_model_len
        else:
            assert c.finish_reason == "stop", c.finish_reason
            assert toks[-1] in stops or p.stop_strings, f"'stop' without a stop token or string: {toks}"
        if p.logprobs is None:
            assert c.logprobs is None
        else:
            assert [lp.token_id for lp in c.logprobs] == toks
            assert all(len(lp.top) == p.logprobs and lp.logprob <= 0.0 for lp in c.logprobs)


def _results(ledger: Ledger) -> dict[str, RequestOutput]:
    """Final outputs of every request that was not aborted."""
    return {**ledger.finished, **ledger.streamed}


def _check_exactly_once(ledger: Ledger, recorder: GroupRecorder) -> None:
    for rid, spec in ledger.specs.items():
        if spec.mode == "stream":
            assert rid in ledger.streamed and not ledger.reports.get(rid), f"stream request {rid} reported by step()"
            continue
        finished_reports = sum(o.finished for o in ledger.reports.get(rid, []))
        outcomes = [rid in ledger.aborted, finished_reports == 1]
        assert finished_reports <= 1 and sum(outcomes) == 1, (
            f"request {rid}: aborted={outcomes[0]} finished reports={finished_reports}")
        if rid in ledger.aborted:
            assert rid in ledger.abort_reports, f"aborted request {rid} was never reported by step()"
            final = recorder.groups[rid].to_output()
            assert final.finished and "abort" in {c.finish_reason for c in final.outputs}
            assert {c.finish_reason for c in final.outputs} <= {"abort", "stop", "length"}


def _check_against_reference(model: torch.nn.Module, llm: LLM, ledger: Ledger, results: dict[str, RequestOutput],
                             tokenizer: Any) -> tuple[int, int]:
    """Greedy (tie-aware, equal logprobs) and seeded (exact) outputs equal a roomy reference run."""
    rids = [rid for rid in results if ledger.specs[rid].kind in ("greedy", "seeded")]
    ref_llm = LLM(model, tokenizer, block_size=16, num_blocks=8192, max_num_seqs=256, max_num_batched_tokens=4096)
    refs = ref_llm.generate([ledger.specs[r].prompt for r in rids], [ledger.specs[r].params for r in rids],
                            use_tqdm=False)
    assert_pool_clean(ref_llm)
    identical = 0  # greedy samples token-for-token equal to the reference
    for rid, ref in zip(rids, refs, strict=True):
        spec, got = ledger.specs[rid], results[rid]
        for g, r in zip(got.outputs, ref.outputs, strict=True):
            if spec.kind == "seeded":
                assert g.token_ids == r.token_ids, f"seeded {rid}/{g.index}: {g.token_ids} != {r.token_ids}"
                continue
            match = check_greedy(model, spec.prompt, spec.params, llm.sampler.eos_token_ids, r.token_ids, g.token_ids)
            assert match.ok, f"greedy {rid}/{g.index}: {match.explain()}\nref={r.token_ids}\ngot={g.token_ids}"
            if match.identical:
                identical += 1
                if spec.params.logprobs is not None:
                    assert_logprobs_close(g, r)
    return len(rids), identical


def _check_against_hf(model: torch.nn.Module, ledger: Ledger, results: dict[str, RequestOutput], rng: random.Random,
                      k: int) -> int:
    plain = [rid for rid, out in results.items() if ledger.specs[rid].kind == "greedy"
             and not ledger.specs[rid].params.min_tokens and not ledger.specs[rid].params.stop_ids
             and not ledger.specs[rid].params.stop_strings]
    chosen = rng.sample(plain, min(k, len(plain)))
    for rid in chosen:
        spec, out = ledger.specs[rid], results[rid]
        ref, logits = hf_greedy(model, spec.prompt, spec.params.max_tokens, eos=not spec.params.ignore_eos)
        for c in out.outputs:
            match = compare_greedy(ref, c.token_ids, logits)
            assert match.ok, f"request {rid} vs HF generate: {match.explain()}\nref={ref}\ngot={c.token_ids}"
    return len(chosen)


# ------------------------------------------------------------------------------------- test
@pytest.mark.parametrize("n_requests", [pytest.param(FULL, marks=pytest.mark.soak, id="full"),
                                        pytest.param(SHORT, id="short")])
def test_soak(model: torch.nn.Module, n_requests: int, request: pytest.FixtureRequest) -> None:
    if n_requests > SHORT and not _long_run_selected(request.config):
        pytest.skip(f"long soak: run with `pytest -m soak` or {SOAK_ENV}=1")
    seed = int(os.environ.get("FLASHPAGE_SOAK_SEED", "20240"))
    rng = random.Random(seed + n_requests)
    tokenizer = tiny_tokenizer() if tiny_tokenizer is not None else None
    specs = _random_specs(rng, n_requests, tokenizer)
    llm = LLM(model, tokenizer, check_invariants=True, **POOL)
    start = time.perf_counter()
    soak = Soak(llm, specs, rng)
    soak.run(max_waves=60 * n_requests)
    elapsed = time.perf_counter() - start
    ledger = soak.ledger

    # every request accounted for exactly once; the pool is back to empty
    assert len(ledger.specs) == n_requests
    _check_exactly_once(ledger, soak.recorder)
    assert_pool_clean(llm)
    kv = llm.kv.stats()
    assert kv.free + kv.cached == kv.num_blocks

    results = _results(ledger)
    for rid, out in results.items():
        _check_well_formed(ledger.specs[rid], out, llm.sampler.eos_token_ids, llm.max_model_len)
    checked, identical = _check_against_reference(model, llm, ledger, results, tokenizer)
    hf_checked = _check_against_hf(model, ledger, results, rng, 100 if n_requests >= FULL else 20)

    st = llm.stats()
    figures = {
        "requests": n_requests,
        "finished": len(results),
        "aborted": len(ledger.aborted),
        "streamed": len(ledger.streamed),
        "tokens_generated": st.generated_tokens,
        "steps": st.steps,
        "preemptions": st.preemptions,
        "evictions": kv.evictions,
        "prefix_hit_rate": round(st.prefix_cache_hit_rate, 3),
        "peak_blocks_in_use": soak.peak_blocks,
        "blocks_total": st.blocks_total,
        "checked_vs_reference": checked,
        "greedy_samples_identical": identical,
        "checked_vs_hf": hf_checked,
        "queued_progress_during_streams": soak.stream_progress,
        "seconds": round(elapsed, 1),
    }
    print(f"\nsoak figures (seed {seed}):", figures)
    assert figures["finished"] + figures["aborted"] == n_requests
    assert figures["aborted"] >= 1 and figures["streamed"] >= 5
    assert figures["tokens_generated"] >= figures["finished"]
    assert figures["preemptions"] > 0, "the pool was meant to force preemption"
    assert figures["evictions"] > 0, "the pool was meant to force prefix-cache evictions"
    assert 0.02 < figures["prefix_hit_rate"] < 1.0
    assert st.blocks_total // 2 < figures["peak_blocks_in_use"] <= st.blocks_total
    assert figures["checked_vs_reference"] >= n_requests // 3
    assert figures["checked_vs_hf"] >= min(20, n_requests // 10)
    assert figures["queued_progress_during_streams"] > 0, "queued requests did not progress during stream()"
