"""Decode-only engine steps through a compiled forward, padded to fixed shapes.

A step in which every scheduled sequence adds one token is padded to a batch-size bucket
(1, 2, 4, 8, ... up to ``max_num_seqs``) and its block table to a width bucket (8, 16, 32, ...
blocks), so every step of a bucket has the same shapes: ``torch.compile(fullgraph=True,
dynamic=False)`` traces each bucket once, and on CUDA its ``"reduce-overhead"`` mode captures it
as a CUDA graph (as vLLM and nano-vllm do). Padding rows write nothing (slot -1) and see no key.
Prefill and mixed steps stay eager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flashpage.cache import PagedKVCache, StepPlan
from flashpage.plan import pad_decode

MIN_WIDTH_BLOCKS = 8


def _bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return 1 << max(n - 1, floor - 1, 0).bit_length()


def default_compile(device: torch.device) -> bool:
    """Compile decode steps by default where it pays: on CUDA (CUDA graphs remove the per-kernel
    launch cost that dominates decode). On CPU inductor's compile time (tens of seconds per bucket)
    outweighs its speed-up for all but long runs, so it is opt-in there (``LLM(compile=True)``)."""
    return device.type == "cuda"


@dataclass
class CompiledDecode:
    """The compiled forward and its bucket bookkeeping for one LLM."""

    model: Any
    cache: Any  # the engine's HFPagedCache
    cache_kwarg: str
    max_num_seqs: int
    device: torch.device
    fn: Any = None
    steps: int = 0
    shapes: set[tuple[int, int]] = field(default_factory=set)  # (batch bucket, width bucket) traced so far

    def __post_init__(self) -> None:
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self.fn = torch.compile(self.model.forward, fullgraph=True, dynamic=False, mode=mode)

    def eligible(self, num_tokens: list[int], emits: list[bool]) -> bool:
        """Decode-only: one token per sequence, every one emitting, within the largest bucket."""
        return bool(num_tokens) and all(n == 1 for n in num_tokens) and all(emits) \
            and len(num_tokens) <= _bucket(self.max_num_seqs)

    def plan(self, kv: PagedKVCache, seq_ids: list[Any]) -> StepPlan:
        """The step's plan padded to its buckets (slots were allocated by the scheduler)."""
        widest = max(len(kv.blocks.block_table(s)) for s in seq_ids)
        width = _bucket(widest, MIN_WIDTH_BLOCKS)
        plan = kv.plan(seq_ids, [1] * len(seq_ids), allocated=True, table_width=width)
        rows = _bucket(len(seq_ids))
        self.shapes.add((rows, width))
        return pad_decode(plan, rows)

    def forward(self, plan: StepPlan, ids: list[int], pos: list[int]) -> torch.Tensor:
        """Run the padded step; returns logits (n, vocab) of the n real sequences."""
        from flashpage.patches.patching import planned_forward

        rows, n = plan.block_table.shape[0], len(ids)
        pad = rows - n
        input_ids = torch.tensor([ids + [0] * pad], device=self.device)
        position_ids = torch.tensor([pos + [0] * pad], device=self.device)
        keep = torch.arange(rows, device=self.device)
        self.cache.set_plan(plan, self.device)
        with planned_forward(self.model, self.cache):
            out = self.fn(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=keep,
                          **{self.cache_kwarg: self.cache})
        self.steps += 1
        return out.logits[0, :n]
