"""Verifying speculative proposals: which proposed tokens a sequence keeps, and the token after them.

A verification chunk of ``1 + d`` tokens (the sequence's last token, then ``d`` proposed ones) yields ``1 + d``
logits rows; row ``i`` is the next-token distribution after the first ``i`` proposed tokens. Each row is
processed exactly as the sampler processes a sequence's row (penalties, ``min_tokens``, the model's
generation-config processors, temperature / top-k / top-p / min-p) on a view of the sequence that already
holds the first ``i`` proposed tokens, and a target token is chosen from it as the sampler would choose it:
argmax (greedy), a draw from the sequence's own generator (seeded), or a draw on the global RNG.
The proposal is kept up to its first token that differs from its row's target; the target of that row
(or, all kept, of the last row: the bonus token) follows.

This is the standard rejection rule for a point-mass proposal q = 1{x}: the proposed x is kept with
probability p(x) = min(1, p(x) / q(x)), and on rejection the emitted token is distributed as p restricted to
tokens != x, normalised, i.e. max(0, p - q) normalised. Each emitted token therefore has the target's
distribution given the tokens before it. A seeded sequence draws exactly one noise vector per emitted token,
in order, from its generator (rows after a rejection are not drawn), so it emits the very tokens it would
emit without speculation, whatever it is batched with.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flashpage.engine.sampler import Sampler, _filtered
from flashpage.engine.sequence import Seq


@dataclass
class Verdict:
    """One sequence's verification.

    Attributes:
        tokens: the tokens to append: the kept proposed tokens, then the target of the first rejected row
            (or the bonus token); ``len(tokens) = accepted + 1``.
        accepted: proposed tokens kept.
        rows: the logits rows (into the verified block) that gave ``tokens``, in order.
    """

    tokens: list[int]
    accepted: int
    rows: list[int]


def row_views(seq: Seq, draft: Sequence[int]) -> list[Seq]:
    """``1 + len(draft)`` shallow copies of ``seq`` whose tokens hold the first 0, 1, ... proposed tokens (what
    the sampler reads: params, tokens, generator, logprobs list). Never appended to: the logprobs list is shared."""
    views = []
    for i in range(len(draft) + 1):
        view = copy.copy(seq)
        view.token_ids = seq.token_ids + list(draft[:i])
        views.append(view)
    return views


def verify(sampler: Sampler, logits: torch.Tensor, seqs: Sequence[Seq],
           drafts: Sequence[Sequence[int]]) -> list[Verdict]:
    """Verify each sequence's proposal.

    Args:
        sampler: the engine's sampler (its processors and EOS ids).
        logits: (sum(1 + len(d) for d in drafts), V) raw logits, sequence after sequence, each one's
            ``1 + len(draft)`` rows in order.
        seqs / drafts: the verified sequences and their proposals (each at least one token).

    Returns:
        One :class:`Verdict` per sequence (rows relative to ``logits``). Records no logprobs.
    """
    for s in seqs:  # a seeded sequence's generator made on the sequence itself, so its views share it
        if s.seed is not None:
            s.generator(logits.device)
    views = [v for s, d in zip(seqs, drafts, strict=True) for v in row_views(s, d)]
    raw = logits.float()
    scores = raw if not sampler._needs_processing(views) else sampler._process(raw.clone(), views)
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    targets = _batched_targets(scores, views, seqs, starts)
    out = []
    for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
        lo = starts[i]
        if seq.group.params.greedy or seq.seed is None:
            verdict = _accept(draft, targets[lo:starts[i + 1]])
        else:
            verdict = _seeded(scores[lo:starts[i + 1]], views[lo:starts[i + 1]], draft)
        verdict.rows = [lo + r for r in verdict.rows]
        out.append(verdict)
    return out


def _batched_targets(scores: torch.Tensor, views: list[Seq], seqs: Sequence[Seq], starts: list[int]) -> list[int]:
    """Every row's target token for the greedy rows (argmax) and the unseeded sampling rows (one draw each on
    the global RNG, as :meth:`Sampler._sample_batched`); 0 for seeded rows (drawn one by one later)."""
    greedy: list[int] = []
    unseeded: list[int] = []
    for i, seq in enumerate(seqs):
        rows = range(starts[i], starts[i + 1])
        if seq.group.params.greedy:
            greedy.extend(rows)
        elif seq.seed is None:
            unseeded.extend(rows)
    targets = [0] * len(views)
    if greedy:
        for r, t in zip(greedy, scores[greedy].argmax(dim=-1).tolist(), strict=True):
            targets[r] = t
    if unseeded:
        drawn = Sampler._sample_batched(scores[unseeded], [views[r] for r in unseeded])
        for r, t in zip(unseeded, drawn, strict=True):
            targets[r] = t
    return targets


def _accept(draft: Sequence[int], targets: Sequence[int]) -> Verdict:
    """Keep the proposal up to its first token that differs from its row's target; then that target."""
    j = 0
    while j < len(draft) and draft[j] == targets[j]:
        j += 1
    return Verdict(list(draft[:j]) + [targets[j]], j, list(range(j + 1)))


def _seeded(scores: torch.Tensor, views: list[Seq], draft: Sequence[int]) -> Verdict:
    """A seeded sequence's rows (1 + d, V), drawn one by one from its generator (as
    :meth:`Sampler._sample_seeded` draws one row), stopping at the first row whose draw differs from the
    proposed token: exactly one draw per emitted token."""
    probs = torch.softmax(_filtered(scores, views), dim=-1)
    tokens: list[int] = []
    for i, row in enumerate(probs):
        noise = torch.empty_like(row).exponential_(generator=views[i].generator(row.device))
        token = int((row / noise).argmax())
        tokens.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return Verdict(tokens, len(tokens) - 1, list(range(len(tokens))))


def record_logprobs(logits: torch.Tensor, seq: Seq, tokens: Sequence[int], rows: Sequence[int]) -> None:
    """Append the logprobs of the emitted ``tokens`` (from the raw ``logits`` rows ``rows``) to ``seq``, as the
    sampler records a decoded token's (log-softmax of the model's raw logits)."""
    if seq.logprobs is None or not tokens:
        return
    Sampler._record_logprobs(logits[list(rows)].float(), [seq] * len(tokens), list(tokens))


def agree(verdicts: Sequence[Verdict], drafts: Sequence[Sequence[int]],
          same_tokens: Callable[[list[int]], list[int]]) -> list[Verdict]:
    """Tensor parallel: rank 0's verdicts on every rank. Each verdict travels as ``1 + len(draft)`` ints (its
    tokens, padded with -1), so the message has the same length on every rank; the rows follow from the tokens
    (a verdict's tokens come from consecutive rows, from the first row of its sequence)."""
    flat: list[int] = []
    for verdict, draft in zip(verdicts, drafts, strict=True):
        flat.extend(verdict.tokens + [-1] * (1 + len(draft) - len(verdict.tokens)))
    agreed = same_tokens(flat)
    out, at = [], 0
    for verdict, draft in zip(verdicts, drafts, strict=True):
        tokens = [t for t in agreed[at:at + 1 + len(draft)] if t >= 0]
        at += 1 + len(draft)
        first = verdict.rows[0]
        out.append(Verdict(tokens, len(tokens) - 1, list(range(first, first + len(tokens)))))
    return out
