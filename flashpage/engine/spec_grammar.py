"""Speculative decoding under structured outputs: the grammar checks proposals and masks every verified row.

A grammar-constrained sequence's proposal is cut at its first token the grammar refuses (llguidance's
``validate_tokens`` on the sequence's matcher, synced to its output), so no refused token is ever verified.
Its verification rows get the masks the grammar gives after the output plus the first 0, 1, ... proposed
tokens (llguidance's ``fill_next_token_bitmask_par_with_draft_tokens``, which leaves the matcher where it was),
exactly the mask each of those tokens would get if decoded one by one: the verifier then sees the same rows
as decoding without speculation, and :meth:`GrammarEngine.accept` advances the matcher as tokens are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flashpage.engine.structured import GrammarEngine, unpack_bitmask


def valid_prefix(engine: GrammarEngine, seq: Any, draft: list[int]) -> list[int]:
    """The longest prefix of ``draft`` that ``seq``'s grammar accepts after its output so far."""
    engine._sync(seq)
    return draft[:seq.grammar.matcher.validate_tokens(draft)]


def mask_rows(engine: GrammarEngine, logits: torch.Tensor, seqs: Sequence[Any],
              drafts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Verification logits with each grammar-constrained row's disallowed tokens at -inf.

    Args:
        engine: the LLM's grammar engine.
        logits: (sum(1 + len(d) for d in drafts), V), sequence after sequence, as :func:`spec_verify.verify`.
        seqs / drafts: the verified sequences (``seq.grammar`` a SeqGrammar or None) and their proposals.

    Returns:
        ``logits`` itself when no sequence has a grammar, else a new (same shape) tensor. A row left with no
        allowed token gets EOS alone (as :meth:`GrammarEngine.apply`).
    """
    jobs, constrained, start = [], [], 0
    for seq, draft in zip(seqs, drafts, strict=True):
        if seq.grammar is not None:
            engine._sync(seq)
            jobs.append((seq.grammar.matcher, start, list(draft)))
            constrained.extend(range(start, start + len(draft) + 1))
        start += len(draft) + 1
    if not jobs:
        return logits
    bitmask = engine._rows(logits.shape[0])
    engine._llg.torch.fill_next_token_bitmask_par_with_draft_tokens(engine.executor, jobs, bitmask)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    allowed[:, engine.eos_token_id] |= ~allowed.any(dim=1)
    free = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    free[torch.tensor(constrained, device=logits.device)] = False
    allowed |= free[:, None]  # rows of sequences without a grammar keep every token
    return logits.masked_fill(~allowed, float("-inf"))
