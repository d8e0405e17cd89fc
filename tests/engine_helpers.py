"""Shared helpers for the engine tests: a small model, prompts and the HF reference outputs."""

from __future__ import annotations

from functools import lru_cache

import torch
from model_zoo import tiny_model

from flashpage.testing import compare_greedy

VOCAB = 128


@lru_cache(maxsize=4)
def engine_model(model_type: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A tiny random model shared by the engine tests (unpatched state is restored by each LLM user)."""
    return tiny_model(model_type, seed=seed, max_position_embeddings=512)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        body = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        out.append((prefix or []) + body)
    return out


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, eos: bool = True):
    """Greedy reference for one unpadded prompt: (new tokens, per-step logits)."""
    from flashpage.patches import is_patched, unpatch

    was = is_patched(model)
    if was:
        unpatch(model)
    kw = {} if eos else {"eos_token_id": None, "min_new_tokens": max_new}
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0, **kw)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = [step[0] for step in out.logits]
    return tokens, logits


def assert_matches_hf(model, prompts, outputs, max_new: int, eos: bool = True) -> int:
    """Every output equals HF's greedy generate (tie-aware); returns how many were identical."""
    identical = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, logits = hf_greedy(model, prompt, max_new, eos)
        match = compare_greedy(ref, out.token_ids, logits)
        assert match.ok, f"prompt of {len(prompt)} tokens: {match.explain()}\nref={ref}\ngot={out.token_ids}"
        identical += match.identical
    return identical
