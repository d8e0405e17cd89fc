"""Engine steps for models whose attention only generate()'s layout reproduces: one sequence per forward.

Two kinds of model are exact in patched ``generate()`` but not in the engine's packed ``[1, T]`` steps:

- a sparse-attention indexer (DeepSeek-V3.2's DSA lightning indexer, GLM-MoE-DSA, Mistral-Large-4's text
  model, ...) picks keys by ``topk`` over one row of scores per query; which of several tied scores (ReLU
  zeros are common) it keeps depends on the row's length and layout (measured: a different token at step 4
  when two requests share a packed step);
- a model that edits the attention mask itself (Qwen4-Exp's indexer selects tokens in the mask, Doge adds a
  dynamic bias to it) needs transformers' mask, which the packed steps never build.

Patched generate() is exact on both because its cache plans each forward itself (``owns_plan``): the model
gets transformers' masks over the row's ``past + L`` keys, the K/V read back densely in the row's layout, and
its indexer keys through ``cache.update_indexer``. So, for such models (``checks.generate_layout_reason``):

- the scheduler cuts chunks as generate() computes tokens (``Scheduler(generate_layout=True)``): a sequence's
  first chunk is its whole prompt (a prompt over ``max_num_batched_tokens`` is refused when added), every later
  chunk one token; a preempted sequence recomputes its outputs one at a time, as they were first computed.
  Prefix caching is off (a prompt computed from a cached block on is not generate()'s prefill);
- the runner (:func:`solo_forward`) runs each chunk of a step as its own forward of shape ``[1, L]`` over
  ``HFPagedCache.over_sequence`` (that sequence as generate()'s cache sees it, over the engine's pool), with
  generate()'s inputs: a 2D attention mask of ones over ``past + L`` columns and positions ``past .. past+L-1``.
  Recurrent states (Qwen4-Exp's gated delta net) come from and go back to the sequence's state slot; the
  positions a model records on the cache for its indexer (Qwen4-Exp's ``indexer_position_ids``) are the
  sequence's own, rebuilt for each forward.

The cost is one forward per scheduled sequence per step (decodes are not batched); every other model keeps the
packed steps, untouched.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.engine.multimodal import language_model_inputs, row_inputs
from flashpage.engine.positions import kept_rows
from flashpage.engine.states import StateSlots, restart_from_scratch
from flashpage.patches import HFPagedCache


@dataclass(frozen=True)
class SoloModel:
    """What a solo step needs: the patched model and how to call it, the engine's pool, the state slots."""

    model: Any
    kv: Any  # the engine's PagedKVCache
    config: Any  # the model's config (for the per-forward cache)
    cache_class: type[HFPagedCache]
    cache_kwarg: str
    device: torch.device
    states: StateSlots | None
    keeps_logits: bool  # the model honours logits_to_keep
    module_states: tuple = ()  # (module, attribute) recurrent state outside the cache (RecurrentGemma)


def solo_forward(solo: SoloModel, chunks: Sequence[Any], keep: Sequence[int]) -> torch.Tensor:
    """One engine step as one ``[1, L]`` forward per chunk (see the module docstring).

    Args:
        chunks: the step's chunks (``seq``, ``start``, ``num_tokens``, ``token_ids``), slots allocated.
        keep: packed row indices whose logits are wanted (as the packed ``[1, T]`` step numbers its tokens).

    Returns:
        (len(keep), V) logits, row ``i`` for packed position ``keep[i]``. On failure the caller rolls the step
        back (and sequences with recurrent states start over: :func:`restart_solo_step`).
    """
    if solo.states is not None:
        solo.states.release_unless(solo.kv.has_sequence)
    ends = [0]
    for c in chunks:
        ends.append(ends[-1] + c.num_tokens)
    rows: list[torch.Tensor | None] = [None] * len(keep)
    for i, chunk in enumerate(chunks):
        wanted = [(j, packed - ends[i]) for j, packed in enumerate(keep) if bisect.bisect_right(ends, packed) - 1 == i]
        logits = _chunk_forward(solo, chunk, [t for _, t in wanted])
        for k, (j, _) in enumerate(wanted):
            rows[j] = logits[k]
    return torch.stack(rows) if rows else torch.empty((0, 0), device=solo.device)


def restart_solo_step(solo: SoloModel, chunks: Sequence[Any]) -> None:
    """After a failed step (rolled back by the scheduler): sequences with recurrent states start over, since the
    forwards of the step that ran advanced their states, which cannot be rolled back."""
    if solo.states is not None:
        restart_from_scratch([c.seq for c in chunks], solo.kv, solo.states)


def _chunk_forward(solo: SoloModel, chunk: Any, local: list[int]) -> torch.Tensor:
    """One chunk's forward as generate() runs it: (len(local), V) logits of its rows ``local``."""
    seq_id, past, n = chunk.seq.seq_id, chunk.start, chunk.num_tokens
    cache = solo.cache_class.over_sequence(solo.kv, solo.config, seq_id, past)
    cache.module_states = list(solo.module_states)
    if solo.states is not None:
        cache.load_states(solo.states.gather([seq_id]) if past else None, solo.states.previous)
    if past:
        _record_positions(cache, chunk, solo.device)
    ids = torch.tensor([chunk.token_ids], device=solo.device)
    pos = torch.arange(past, past + n, device=solo.device)[None]
    inputs, deep = row_inputs(solo.model, [chunk], ids, pos)  # image requests: embeddings, M-RoPE positions
    mask = torch.ones((1, past + n), dtype=torch.long, device=solo.device)
    rows = torch.tensor(local or [n - 1], dtype=torch.long, device=solo.device)
    with language_model_inputs(solo.model, deep):
        out = solo.model(**inputs, attention_mask=mask, use_cache=True, logits_to_keep=rows,
                         **{solo.cache_kwarg: cache})
    if solo.states is not None:
        states, previous = cache.read_states()
        solo.states.scatter([seq_id], states, previous)
    return kept_rows(out.logits[0], rows, solo.keeps_logits)


def _record_positions(cache: HFPagedCache, chunk: Any, device: torch.device) -> None:
    """The positions of the sequence's ``chunk.start`` computed tokens, (3, 1, past), on every cache layer, as
    a model that records its indexer's positions on the cache (Qwen4-Exp: ``indexer_position_ids``) left them
    after generate()'s earlier forwards of this one row (layers the model does not read ignore them)."""
    past = chunk.start
    mm = getattr(chunk.seq.group, "mm", None)
    if mm is not None and mm.mrope is not None:
        positions = mm.rope_positions(0, past)[:, None, :]
    else:
        positions = torch.arange(past).view(1, 1, past).expand(3, 1, past)
    for layer in cache.layers:
        if hasattr(layer, "indexer_position_ids"):
            layer.indexer_position_ids = positions.to(device)
