"""`flashpage bench rl`: GRPO rollouts with flashpage vs TRL's own generation, and on-policy numbers.

Pieces:
- :func:`onpolicy_gap`: rollout logprobs against the trainer's own recomputation of the same tokens
  (``GRPOTrainer._get_per_token_logps_and_entropies`` on the padded batch TRL builds; what TRL's
  importance-sampling ratio compares): max and mean |difference|.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LogprobGap:
    """|rollout logprob - trainer logprob| over every completion token."""

    max_abs: float
    mean_abs: float
    tokens: int


def trainer_logprobs(trainer: Any, rollout: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's per-token logprobs of the rollout's completions, computed as GRPOTrainer computes
    them for the loss (prompts left-padded, completions right-padded, one batch, ``logits / temperature``).

    Returns:
        ``(logps (B, Lc) float32, mask (B, Lc) bool)`` on the CPU.
    """
    from trl.trainer.utils import pad

    pad_id = trainer._tokenizer.pad_token_id
    device = trainer.accelerator.device
    prompts = [torch.tensor(p) for p in rollout["prompt_ids"]]
    completions = [torch.tensor(c) for c in rollout["completion_ids"]]
    prompt_ids = pad(prompts, padding_value=pad_id, padding_side="left").to(device)
    prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)
    completion_ids = pad(completions, padding_value=pad_id, padding_side="right").to(device)
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right").to(device)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, completion_ids.size(1))
    return logps.float().cpu(), completion_mask.bool().cpu()


def onpolicy_gap(trainer: Any, rollout: dict[str, list]) -> LogprobGap:
    """Max and mean |rollout logprob - trainer recomputation| over all completion tokens."""
    ref, mask = trainer_logprobs(trainer, rollout)
    got = torch.zeros_like(ref)
    for i, lps in enumerate(rollout["logprobs"]):
        got[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    diff = (got - ref).abs()[mask]
    if diff.numel() == 0:
        return LogprobGap(0.0, 0.0, 0)
    return LogprobGap(float(diff.max()), float(diff.mean()), int(diff.numel()))
