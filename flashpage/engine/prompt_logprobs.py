"""Prompt logprobs (``SamplingParams.prompt_logprobs``), computed in the packed prefill.

The logits at sequence position ``p`` predict token ``p + 1``, so a prefill chunk of ``n`` tokens
from ``start`` yields the logprobs of the prompt tokens ``start + 1 .. start + n`` (those still in
the prompt). The engine keeps exactly those rows of the packed forward (``logits_to_keep``, after
the rows of the emitting chunks) for the requests that asked, and :func:`record` appends one
:class:`TokenLogprob` per prompt token, in order, to ``Group.prompt_logprobs``.

An entry is recorded once: a prompt recomputed after preemption skips what it already has. A
request whose prompt logprobs are incomplete takes no prefix-cache hits (:func:`pending`), so its
whole prompt passes through the forward (what vLLM does too); once complete (a preempted request
resuming), hits are used again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashpage.engine.outputs import TokenLogprob
from flashpage.engine.sequence import Group, Seq

if TYPE_CHECKING:
    from flashpage.engine.scheduler import Chunk


def pending(seq: Seq) -> bool:
    """Whether ``seq`` still has prompt logprobs to compute (sample 0 of a request that asked)."""
    lps = seq.group.prompt_logprobs
    return lps is not None and seq.index == 0 and len(lps) < seq.num_prompt


@dataclass
class PromptRows:
    """The rows of one step's packed forward kept for prompt logprobs.

    Attributes:
        flat: indices into the step's packed tokens (``input_ids[0, flat]``), in order.
        parts: ``(group, first position, count)`` per chunk: rows ``flat[r:r + count]`` are the
            positions ``first .. first + count - 1`` of that group's prompt.
    """

    flat: list[int] = field(default_factory=list)
    parts: list[tuple[Group, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.flat)


def plan_rows(chunks: Sequence[Chunk]) -> PromptRows:
    """The rows of ``chunks`` (packed in this order) whose logits give prompt logprobs still missing."""
    rows = PromptRows()
    offset = 0
    for c in chunks:
        seq = c.seq
        if pending(seq):
            done = len(seq.group.prompt_logprobs or ())
            lo = max(c.start, done - 1)  # position p gives entry p + 1
            hi = min(c.start + c.num_tokens, seq.num_prompt - 1)  # the last prompt position predicts output
            if hi > lo:
                rows.flat.extend(range(offset + lo - c.start, offset + hi - c.start))
                rows.parts.append((seq.group, lo, hi - lo))
        offset += c.num_tokens
    return rows


def record(rows: PromptRows, logits: torch.Tensor) -> None:
    """Append the prompt logprobs that ``logits`` give to each group of ``rows``.

    Args:
        rows: from :func:`plan_rows` for the step that produced ``logits``.
        logits: (len(rows.flat), V) raw logits of the kept rows, in ``rows.flat`` order.
    """
    if not rows:
        return
    logp = torch.log_softmax(logits.float(), dim=-1)
    targets = [t for g, lo, count in rows.parts for t in g.prompt_token_ids[lo + 1:lo + 1 + count]]
    index = torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None]
    actual = logp.gather(1, index).squeeze(1).tolist()
    k_max = max(g.params.prompt_logprobs or 0 for g, _, _ in rows.parts)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k_max:
        vals, ids = logp.topk(k_max, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    r = 0
    for group, lo, count in rows.parts:
        k = group.params.prompt_logprobs or 0
        entries = group.prompt_logprobs
        assert entries is not None and len(entries) == lo + 1, "prompt logprobs recorded out of order"
        for _ in range(count):
            top = dict(zip(top_ids[r][:k], top_vals[r][:k], strict=True)) if k else {}
            entries.append(TokenLogprob(targets[r], actual[r], top))
            r += 1
