"""Oracle helpers: compare greedy outputs token for token, allowing a difference only at a tie.

A greedy continuation may legitimately differ from the reference where the reference's top-2
logits are equal within ``tol`` (float rounding decides the argmax there); after that point the
two continuations are unrelated. Everything else must match exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TIE_TOL = 1e-5


@dataclass(frozen=True)
class GreedyMatch:
    """Outcome of comparing one greedy continuation with the reference.

    Attributes:
        ok: identical, or first differing at a reference tie.
        identical: token-for-token equal (over the compared length).
        position: index of the first difference (None when identical).
        gap: the reference's top-1 minus top-2 logit at ``position`` (None when identical).
    """

    ok: bool
    identical: bool
    position: int | None = None
    gap: float | None = None

    def explain(self) -> str:
        if self.identical:
            return "identical"
        verdict = "tie (allowed)" if self.ok else "NOT a tie"
        return f"first difference at new token {self.position}: reference top-2 gap {self.gap:.3g} -> {verdict}"


def top2_gap(logits: torch.Tensor) -> float:
    """top-1 minus top-2 of a (V,) logits row."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def tie_tol(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """The largest top-2 gap that counts as a tie when the model computed in ``dtype``: :data:`TIE_TOL` in
    float32 / float64; in half precision two rounding steps of ``dtype`` at the row's largest |logit| (bfloat16
    rounds a logit near 8 in steps of 0.0625, so its ties come out as gaps of 0 or a step or two, not 1e-5)."""
    if torch.finfo(dtype).bits >= 32:
        return TIE_TOL
    top = float(logits.float().abs().max())
    step = 2.0 ** math.floor(math.log2(top)) * torch.finfo(dtype).eps if top > 0 else torch.finfo(dtype).eps
    return max(TIE_TOL, 2.0 * step)


def compare_greedy(reference: Sequence[int], got: Sequence[int], reference_logits: Sequence[torch.Tensor] | None,
                   tol: float = TIE_TOL, dtype: torch.dtype | None = None) -> GreedyMatch:
    """Compare ``got`` with ``reference`` (new tokens only).

    Args:
        reference: the reference's greedy tokens.
        got: the tokens under test.
        reference_logits: the reference's logits row (V,) that chose each reference token.
        tol: the largest top-2 gap that counts as a tie.
        dtype: the dtype the models computed in; half precision widens ``tol`` to :func:`tie_tol`'s.
    """
    n = min(len(reference), len(got))
    for i in range(n):
        if reference[i] != got[i]:
            if reference_logits is None or i >= len(reference_logits):
                return GreedyMatch(False, False, i, float("nan"))
            gap = top2_gap(reference_logits[i])
            limit = max(tol, tie_tol(dtype, reference_logits[i])) if dtype is not None else tol
            return GreedyMatch(gap <= limit, False, i, gap)
    if len(reference) != len(got):
        # one stopped earlier without a token difference (e.g. EOS vs length): not identical
        return GreedyMatch(False, False, n, float("nan"))
    return GreedyMatch(True, True)
