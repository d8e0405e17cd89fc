"""Speculative decoding for :class:`flashpage.LLM`: the config, the n-gram proposer and the switch-offs.

(Draft-model proposals, ``{"model": ..., "num_speculative_tokens": k}``, are :mod:`flashpage.engine.spec_draft`'s;
everything below but the n-gram lookup applies to them too.)

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
"prompt_lookup_min": m})`` (vLLM's keys). Before each step, :meth:`Speculator.propose` looks, for every
running decode sequence, for the longest suffix of its tokens (between ``m`` and ``n`` tokens long) that
occurred earlier in the same sequence, and proposes the up to ``k`` tokens that followed its most recent
earlier occurrence (prompt lookup). The scheduler appends a sequence's proposal to its decode chunk (one
multi-token query on the pages, every row emitting logits), the sampler verifies it
(:mod:`flashpage.engine.spec_verify`), and the engine truncates the K/V of rejected tokens.

Grammar-constrained sequences (structured outputs) get proposals cut at the first token their grammar refuses,
and masks on every verified row (:mod:`flashpage.engine.spec_grammar`). Which sequences get no proposal (each
keeps decoding one token a step, exactly as without speculation): a sample whose siblings are not forked yet
(``n > 1`` on its first step), the last token of ``max_tokens`` / the context, and a running batch of
``disable_by_batch_size`` or more sequences.

Speculation also switches itself off where it does not pay. Verifying a proposed token costs about
``1 / (B + O)`` of a step of ``B`` sequences (a step's fixed cost is worth about ``O`` tokens:
``STEP_OVERHEAD_TOKENS`` of the device), and saves a step's share ``1 / B`` if accepted. So the j-th proposed
token of a sequence is worth its cost when the chance it is accepted, ``a ** j`` (``a``: the sequence's
per-token acceptance rate, a decayed estimate that starts from the engine-wide rate), is at least
``B / (B + O)``: at batch 1 nearly any proposal pays, at batch 32 only well-accepted ones.
A sequence that rates no token worth proposing probes with one token after 2, 4, ... 32 steps (rejected
probes double the wait), so its rate can recover. When the engine-wide recent rate says not even one token
is worth proposing at the current batch size, only every ``PROBE_PERIOD``-th step (times B // 8 at larger
batches, where a probe costs more) looks for proposals at all (an open-ended workload at a large batch then pays
almost nothing for speculation being on).

Under tensor parallelism every rank runs this same speculator on its replicated scheduler state: n-gram proposals
and every switch-off decision depend only on the sequences' tokens and the verification counts, which all ranks
agree on, so every rank proposes the same; a draft model (loaded whole on every rank) proposes greedily and rank
0's proposals are broadcast anyway (``agree``: a float argmax need not be bit-equal across devices). The step
digest covers each chunk's proposal (engine/distributed.py), and the verified tokens are rank 0's
(:func:`flashpage.engine.spec_verify.agree`), so every rank keeps and rolls back the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
METHODS = ("ngram", "draft_model")
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_max / _min when neither is given
CANDIDATES = 4  # latest occurrences of a sequence's last prompt_lookup_min tokens tried for a longer match
MAX_BACKOFF = 32  # steps a sequence whose proposals keep failing waits at most before proposing again
# a step's fixed cost, in tokens' worth of compute (see the module docstring): on CPU a few tokens' GEMM rows;
# on CUDA a decode step is bound by reading the weights, and hundreds of tokens cost about as much as one
STEP_OVERHEAD_TOKENS = {"cpu": 16, "cuda": 256}
DECAY = 0.8  # weight of a sequence's older verifications in its acceptance-rate estimate
PRIOR_WEIGHT = 2.0  # how many verified tokens the engine-wide rate counts as, in a sequence's estimate
RECENT_DECAY = 0.98  # per verification: the weight of older ones in the engine-wide recent rate
PROBE_PERIOD = 8  # steps between proposal rounds while the engine-wide recent rate does not pay (batch <= 15)


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated ``speculative_config`` (see :meth:`parse`).

    Attributes:
        num_speculative_tokens: tokens proposed per sequence and step at most (k >= 1).
        prompt_lookup_max / prompt_lookup_min: the longest / shortest suffix n-gram looked up.
        disable_by_batch_size: no proposals in steps with at least this many running sequences (None: never).
        method: ``"ngram"`` (prompt lookup) or ``"draft_model"`` (``model`` given: :mod:`flashpage.engine.spec_draft`).
        model: the draft model (a path / hub id or a model object), for ``"draft_model"``.
    """

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None
    method: str = "ngram"
    model: Any = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """Check a user's ``speculative_config`` (a dict with vLLM's keys); None stays None. Raises ValueError
        naming the key at fault and the fix."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4, 'prompt_lookup_max': 4}}, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; the keys are {list(KEYS)}")
        method = value.get("method", "ngram" if value.get("model") is None else "draft_model")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method={method!r} is not supported; use one of {list(METHODS)} "
                             "(draft_model with 'model': a path or a model object)")
        k = _positive(value, "num_speculative_tokens", None)
        if k is None:
            raise ValueError("speculative_config: num_speculative_tokens is required (tokens proposed per step, "
                             "e.g. 4)")
        if method == "draft_model":
            return cls._draft(value, k)
        high = _positive(value, "prompt_lookup_max", None)
        low = _positive(value, "prompt_lookup_min", None)
        if high is None and low is None:  # vLLM's defaults: 5 and 5; each defaults to the other
            high = low = DEFAULT_LOOKUP
        high = high if high is not None else low
        low = low if low is not None else high
        assert high is not None and low is not None
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} is more than prompt_lookup_max={high}; "
                             "give prompt_lookup_min <= prompt_lookup_max")
        if value.get("model") is not None:
            raise ValueError("speculative_config: 'model' is for method='draft_model'; leave it out with "
                             "method='ngram'")
        return cls(k, high, low, _positive(value, "disable_by_batch_size", None), method)

    @classmethod
    def _draft(cls, value: Mapping[str, Any], k: int) -> SpeculativeConfig:
        """A draft-model config: ``model`` required, the n-gram keys refused."""
        model = value.get("model")
        if model is None or isinstance(model, (bytes, int, float, bool)):
            raise ValueError("speculative_config: method='draft_model' needs 'model': a checkpoint path, a hub id "
                             "or a model object sharing the target's tokenizer")
        lookup = sorted(key for key in ("prompt_lookup_max", "prompt_lookup_min") if key in value)
        if lookup:
            raise ValueError(f"speculative_config: {lookup} apply to method='ngram', not to a draft model; leave "
                             "them out")
        return cls(k, 0, 0, _positive(value, "disable_by_batch_size", None), "draft_model", model)


def _positive(value: Mapping[str, Any], key: str, default: int | None) -> int | None:
    got = value.get(key, default)
    if got is None:
        return None
    if isinstance(got, bool) or not isinstance(got, int) or got < 1:
        raise ValueError(f"speculative_config: {key} must be a positive int, got {got!r}")
    return got


@dataclass
class NgramIndex:
    """Where the ``low``-grams of one sequence's tokens occurred: one small entry per token (memory linear in
    the sequence, whatever ``high - low``). Grows with the sequence (its tokens only ever grow: proposals are
    never appended to it).

    Attributes:
        low / high: the shortest / longest suffix matched.
        ends: hash of a ``low``-gram -> the ends (exclusive) of its latest ``CANDIDATES`` occurrences, oldest
            first, among those ending at or before ``upto`` (a hash collision is caught by comparing tokens).
        upto: every occurrence ending at a position <= upto is indexed.
    """

    low: int
    high: int
    ends: dict[int, list[int]] = field(default_factory=dict)
    upto: int = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed an earlier occurrence of a suffix of ``tokens`` of ``low`` to ``high``
        tokens: the longest such suffix among the latest ``CANDIDATES`` occurrences of the last ``low`` tokens
        (the latest of equally long ones); [] when none occurred before."""
        length = len(tokens)
        if length <= self.low:
            return []
        self._index(tokens, length - 1)  # occurrences ending before the suffix itself
        best, best_end = 0, -1
        for end in reversed(self.ends.get(hash(tuple(tokens[length - self.low:])), ())):
            matched = 0
            while matched < self.high and matched < end and tokens[end - 1 - matched] == tokens[length - 1 - matched]:
                matched += 1
            if matched >= self.low and matched > best:
                best, best_end = matched, end
                if matched == self.high:
                    break
        return tokens[best_end:min(best_end + k, length)] if best else []

    def _index(self, tokens: list[int], last_end: int) -> None:
        for end in range(max(self.upto + 1, self.low), last_end + 1):
            ends = self.ends.setdefault(hash(tuple(tokens[end - self.low:end])), [])
            ends.append(end)
            if len(ends) > CANDIDATES:
                del ends[0]
        self.upto = max(self.upto, last_end)


@dataclass
class SeqSpec:
    """One sequence's speculation state (``Seq.spec``): its n-gram index, its acceptance record and back-off."""

    index: NgramIndex
    accepted: float = 0.0  # decayed count of accepted proposed tokens
    tried: float = 0.0  # decayed count of verified proposed tokens up to the first rejected one (inclusive)
    misses: int = 0  # proposals rejected outright in a row
    wait: int = 0  # steps left before a probe

    def rate(self, prior: float) -> float:
        """Per-token acceptance estimate, shrunk towards ``prior`` (the engine-wide rate)."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.tried + PRIOR_WEIGHT)

    def record(self, proposed: int, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (1 if accepted < proposed else 0)
        if accepted == 0:
            self.misses += 1
            self.wait = min(1 << self.misses, MAX_BACKOFF)
        else:
            self.misses = self.wait = 0


def worth_proposing(rate: float, threshold: float, limit: int) -> int:
    """The most tokens j <= limit whose last one is accepted with probability rate ** j >= threshold."""
    if rate >= 1.0 or threshold <= 0.0:
        return limit
    if rate <= 0.0 or rate < threshold:
        return 0
    return min(limit, int(math.log(threshold) / math.log(rate) + 1e-9))


@dataclass
class SpecCounters:
    """What speculation did so far (``LLM.stats()``)."""

    proposed: int = 0  # proposed tokens verified
    accepted: int = 0  # of those, accepted
    verifications: int = 0  # verified proposals (one per sequence and step)
    emitted: int = 0  # tokens the verifications produced (accepted + the corrected / bonus one)
    tried: int = 0  # proposed tokens up to each proposal's first rejected one (inclusive)
    recent_accepted: float = 0.0  # accepted, decayed by RECENT_DECAY per verification
    recent_tried: float = 0.0  # tried, decayed alike

    @property
    def rate(self) -> float:
        """Engine-wide recent per-token acceptance rate (1/2 before any verification)."""
        return (self.recent_accepted + 1.0) / (self.recent_tried + 2.0)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verified sequence-step (1.0: no gain; up to k + 1)."""
        return self.emitted / self.verifications if self.verifications else 0.0


class Speculator:
    """Proposes tokens for the running decode sequences and learns from the verifications."""

    def __init__(self, config: SpeculativeConfig, device_type: str = "cpu", draft: Any = None,
                 agree: Callable[[list[list[int]]], list[list[int]]] | None = None) -> None:
        self.config = config
        self.draft = draft  # a spec_draft.DraftProposer for method="draft_model"
        # tensor parallel, draft model: rank 0's proposals (in the order of the sequences asked), on every rank
        self.agree = agree
        self.counters = SpecCounters()
        self.steps = 0  # propose() calls
        self.step_overhead_tokens: float = STEP_OVERHEAD_TOKENS.get(device_type, STEP_OVERHEAD_TOKENS["cuda"])

    def propose(self, running: Iterable[Any],
                check: Callable[[Any, list[int]], list[int]] | None = None) -> dict[int, list[int]]:
        """seq_id -> proposed tokens, for the running sequences (``Seq``) that decode next and may speculate.
        ``check(seq, draft)`` cuts a grammar-constrained sequence's proposal to what its grammar accepts
        (engine/spec_grammar.py); without it such sequences get no proposal."""
        seqs = list(running)
        if self.draft is not None:  # shadows of sequences preempted since are freed
            self.draft.release_except(seqs)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(seqs) >= limit:
            return {}
        threshold = len(seqs) / (len(seqs) + self.step_overhead_tokens)
        prior = self.counters.rate
        self.steps += 1
        if worth_proposing(prior, threshold, 1) == 0 and self.steps % (PROBE_PERIOD * max(1, len(seqs) // 8)):
            return {}
        wanted: dict[Any, int] = {}
        for seq in seqs:
            k = self._budget(seq)
            if k <= 0:
                continue
            state = self._state(seq)
            n = worth_proposing(state.rate(prior), threshold, k)
            if n == 0:  # not worth it: a one-token probe now and then
                if state.wait > 0:
                    state.wait -= 1
                    continue
                n = 1
            wanted[seq] = n
        wanted = {s: n for s, n in wanted.items() if s.grammar is None or check is not None}
        if self.draft is not None:
            out = self.draft.propose(wanted)
            if self.agree is not None:  # a float model's argmax: every rank takes rank 0's
                out = _agreed(out, [s.seq_id for s in wanted], self.agree)
        else:
            out = {s.seq_id: s.spec.index.propose(s.token_ids, n) for s, n in wanted.items()}
        if check is not None:
            for seq in wanted:
                if seq.grammar is not None and out.get(seq.seq_id):
                    out[seq.seq_id] = check(seq, out[seq.seq_id])
        return {sid: d for sid, d in out.items() if d}

    def forget(self, seq: Any) -> None:
        """``seq`` finished or was aborted: a draft model's shadow of it is freed."""
        if self.draft is not None:
            self.draft.release(seq.seq_id)

    def _budget(self, seq: Any) -> int:
        """Tokens ``seq`` may have proposed this step: 0 unless it decodes one token next and may speculate;
        never so many that accepting them all (plus the bonus token) passes max_tokens or the context."""
        group, p = seq.group, seq.group.params
        if seq.remaining != 1 or seq.num_output == 0 or len(group.seqs) < p.n:
            return 0
        return min(self.config.num_speculative_tokens, p.max_tokens - seq.num_output - 1,
                   group.max_total_tokens - len(seq.token_ids) - 1)

    def _state(self, seq: Any) -> SeqSpec:
        if seq.spec is None:
            seq.spec = SeqSpec(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        return seq.spec

    def observe(self, seq: Any, proposed: int, accepted: int, emitted: int) -> None:
        """After verifying ``proposed`` tokens of ``seq``: ``accepted`` of them held, ``emitted`` tokens appended."""
        c = self.counters
        c.proposed += proposed
        c.accepted += accepted
        c.verifications += 1
        c.emitted += emitted
        tried = accepted + (1 if accepted < proposed else 0)
        c.tried += tried
        c.recent_accepted = RECENT_DECAY * c.recent_accepted + accepted
        c.recent_tried = RECENT_DECAY * c.recent_tried + tried
        self._state(seq).record(proposed, accepted)


def _agreed(out: dict[int, list[int]], order: list[int],
            agree: Callable[[list[list[int]]], list[list[int]]]) -> dict[int, list[int]]:
    """``out`` (seq_id -> proposal) replaced by rank 0's proposals for the same sequences (``order``: the seq_ids
    asked, the same on every rank). If the ranks asked for different numbers of sequences, ``out`` is kept:
    the step's digest check then stops every rank."""
    theirs = agree([out.get(sid, []) for sid in order])
    if len(theirs) != len(order):
        return out
    return dict(zip(order, theirs, strict=True))


def check_spec_support(config: SpeculativeConfig | None, model: Any, recurrent: bool, tensor_parallel: bool) -> None:
    """Refuse speculation where the engine cannot make it exact: recurrent (SSM / linear-attention) layers, whose
    state cannot be rolled back past rejected tokens cheaply; under tensor parallelism, a draft model object that
    is itself sharded (the draft runs whole on every rank, see :mod:`flashpage.engine.spec_draft`)."""
    if config is None:
        return
    name = type(model).__name__
    if recurrent:
        raise ValueError(f"speculative_config: {name} has recurrent (SSM / linear-attention) layers, whose state "
                         "cannot be rolled back past rejected tokens; leave speculative_config out for this model")
    draft_tp = int(getattr(config.model, "_tp_size", None) or 1)
    if draft_tp > 1:
        where = "every tensor-parallel rank" if tensor_parallel else "the target's process"
        raise ValueError(f"speculative_config: the draft model is sharded over {draft_tp} ranks (loaded with "
                         f"tp_plan=); a draft model runs whole on {where}: load it without tp_plan, or give its "
                         "path")
