"""Draft-model proposals for speculative decoding: a smaller model of the same vocabulary guesses the next tokens.

``LLM(..., speculative_config={"model": PATH_OR_MODEL, "num_speculative_tokens": k})``. The draft runs as its own
:class:`flashpage.LLM` (its own patched model, paged pool and model runner; no prefix caching, no speculation),
whose scheduler is not used: :class:`DraftProposer` keeps one shadow sequence per target sequence in the draft's
pool and drives the draft's runner directly. One proposal round for the sequences that speculate this step:

1. one packed forward of every shadow's uncomputed tokens (what the target accepted since, and its newest
   token), the argmax of each shadow's last row is its first proposed token;
2. ``k - 1`` packed forwards of one token per shadow (the previous proposed token), each adding one more.

Proposals are greedy (a point mass), so the verifier's rule (:mod:`flashpage.engine.spec_verify`) keeps the
target's distribution whatever the draft proposes. Before each round a shadow's cache is cut back to the longest
prefix of what it computed that the target sequence still has (so rejected proposals go); shadows of sequences
no longer running are freed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from flashpage.engine.outputs import RequestMetrics
from flashpage.engine.params import SamplingParams
from flashpage.engine.scheduler import Chunk, Schedule
from flashpage.engine.sequence import Group, Seq
from flashpage.errors import NoFreeBlocksError


class DraftProposer:
    """Greedy proposals from a draft model for the target's running sequences.

    Args:
        draft: the draft's :class:`flashpage.LLM` (built by :func:`build_draft`).
        vocab_size: the target's vocabulary size (the draft's must be the same).
    """

    def __init__(self, draft: Any, vocab_size: int) -> None:
        if draft.vocab_size != vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary has {draft.vocab_size} tokens, the "
                             f"target's {vocab_size}; a draft model must share the target's tokenizer")
        self.llm = draft
        self._group = Group("draft", None, [0], SamplingParams(), RequestMetrics(time.perf_counter()))
        self._shadows: dict[int, Seq] = {}  # target seq_id -> its shadow in the draft's pool
        self._computed: dict[int, list[int]] = {}  # target seq_id -> the tokens whose K/V the shadow's cache holds

    def propose(self, wanted: Mapping[Seq, int]) -> dict[int, list[int]]:
        """target seq_id -> up to ``wanted[seq]`` greedy draft tokens, for the target sequences of ``wanted``."""
        need = {s.seq_id: n for s, n in wanted.items() if n > 0}
        shadows = self._sync([s for s in wanted if s.seq_id in need])
        out: dict[int, list[int]] = {sid: [] for sid in shadows}
        active = list(shadows)
        while active:
            tokens = self._forward({sid: shadows[sid] for sid in active})
            for sid, token in tokens.items():
                out[sid].append(token)
                shadows[sid].token_ids.append(token)
            active = [sid for sid in tokens if len(out[sid]) < need[sid]]
        return {sid: d for sid, d in out.items() if d}

    def release_except(self, running: Sequence[Seq]) -> None:
        """Free the shadows of sequences not in ``running`` (finished, aborted or preempted)."""
        alive = {s.seq_id for s in running}
        for sid in [sid for sid in self._shadows if sid not in alive]:
            self.release(sid)

    def release(self, sid: int) -> None:
        """Free the shadow of target sequence ``sid`` (if it has one)."""
        shadow = self._shadows.pop(sid, None)
        self._computed.pop(sid, None)
        if shadow is not None and self.llm.kv.has_sequence(shadow.seq_id):
            self.llm.kv.free(shadow.seq_id)

    def _sync(self, seqs: list[Seq]) -> dict[int, Seq]:
        """Each sequence's shadow holding its current tokens (made on first use), its cache cut back to the
        longest prefix it computed that the sequence still has (rejected proposals go), leaving at least the
        newest token to compute."""
        shadows = {}
        for seq in seqs:
            shadow = self._shadows.get(seq.seq_id)
            if shadow is None:
                shadow = Seq(self._group, 0, [])
                shadow.in_cache = True  # the draft runner's rollback of a failed forward truncates it
                self.llm.kv.add_sequence(shadow.seq_id)
                self._shadows[seq.seq_id] = shadow
                self._computed[seq.seq_id] = []
            computed, tokens = self._computed[seq.seq_id], seq.token_ids
            keep = _common_prefix(computed, tokens, len(tokens) - 1)
            if keep < shadow.num_computed:
                self.llm.kv.truncate(shadow.seq_id, keep)
                shadow.num_computed = keep
                del computed[keep:]
            shadow.token_ids = list(tokens)
            shadows[seq.seq_id] = shadow
        return shadows

    def _forward(self, shadows: dict[int, Seq]) -> dict[int, int]:
        """One packed draft forward of each shadow's uncomputed tokens: target seq_id -> the argmax after its
        last token (shadows the draft's pool cannot extend are left out)."""
        chunks: list[Chunk] = []
        sids: list[int] = []
        for sid, shadow in shadows.items():
            start, n = shadow.num_computed, len(shadow.token_ids) - shadow.num_computed
            try:
                slots = self.llm.kv.blocks.append(shadow.seq_id, n)
            except NoFreeBlocksError:  # the draft's pool is full: no more proposals for this one now
                continue
            chunks.append(Chunk(shadow, start, n, slots))
            sids.append(sid)
        if not chunks:
            return {}
        logits = self.llm.runner.run(Schedule(chunks))  # advances each shadow's num_computed
        for sid, chunk in zip(sids, chunks, strict=True):
            self._computed[sid].extend(chunk.token_ids)
        return dict(zip(sids, logits.argmax(dim=-1).tolist(), strict=True))


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def build_draft(model: Any, target: Any, max_num_seqs: int) -> Any:
    """The draft's LLM: ``model`` (a path / hub id, loaded on the target's device, or a model object) over a pool
    as large as the target's, without prefix caching (its shadows are cut back at every rejection). Its errors
    (a vocabulary or context shorter than the target's...) are raised as ValueErrors naming the draft model."""
    from flashpage.engine.llm import LLM

    config = getattr(model, "config", None)
    if config is not None:  # a model object: the vocabulary is checked before anything is built
        vocab = config.get_text_config(decoder=True).vocab_size
        if vocab != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary has {vocab} tokens, the target's "
                             f"{target.vocab_size}; a draft model must share the target's tokenizer")
    device = target.device if isinstance(model, (str, os.PathLike)) else None
    try:
        return LLM(model, tokenizer=None, max_num_seqs=max_num_seqs, num_blocks=target.kv.num_blocks,
                   block_size=target.kv.block_size, max_model_len=target.max_model_len, enable_prefix_caching=False,
                   device=device, compile=False, generation_config="vllm")
    except ValueError as exc:
        raise ValueError(f"speculative_config: the draft model cannot serve this LLM: {exc}") from None
