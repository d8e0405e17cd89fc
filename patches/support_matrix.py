"""Support matrix: which model families ``flashpage.patch`` reproduces exactly, and by which path.

For each ``(model_type, config)`` pair, :func:`run_matrix` builds the model (random weights, fp32,
CPU unless the builder says otherwise), runs greedy ``generate()`` on a left-padded batch
unpatched and patched (the same model object), and reports one row::

    {"family": "llama", "path": "interface", "attention": "pagedkv", "exact": True,
     "max_logit_diff": 4.8e-07, "error": None}

- ``path``: how the family is routed (``"interface"`` or ``"dense-view"``, see ``families.py``);
- ``attention``: ``config._attn_implementation`` while patched (flashpage's, or the model's own
  for families that bypass the attention interface);
- ``exact``: the patched tokens equal the unpatched ones for every row;
- ``max_logit_diff``: largest absolute difference of the per-step logits, over the steps where
  both runs still had the same prefix (up to and including each row's first differing token);
- ``error``: ``"ExcType: message"`` when the patched run failed (then ``exact`` is False).

:func:`format_markdown` renders the rows as a Markdown table (for README). Nothing here
imports the test suite: callers pass the configs (and, optionally, how to build a model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from flashpage.patches.families import family_for
from flashpage.patches.patching import patch, patch_state, unpatch

Row = dict[str, Any]
ModelBuilder = Callable[[str, Any], torch.nn.Module]


def run_matrix(
    families: Iterable[tuple[str, Any]],
    *,
    build_model: ModelBuilder | None = None,
    prompt_lengths: Sequence[int] = (5, 11, 8),
    max_new_tokens: int = 12,
    seed: int = 0,
) -> list[Row]:
    """Compare patched and unpatched greedy generation for each family.

    Args:
        families: ``(model_type, config)`` pairs; ``config`` is a transformers config or a
            mapping of config keyword arguments (``AutoConfig.for_model(model_type, **config)``).
        build_model: ``(model_type, config) -> model``; default: ``from_config`` in float32
            under ``torch.manual_seed(seed)``, in eval mode.
        prompt_lengths: real lengths of the left-padded prompts (one batch row each).
        max_new_tokens: tokens generated per row (EOS disabled, so every row runs to the end).
        seed: seed for the default builder and the random prompts.

    Returns:
        One row per family, in input order (keys: family, path, attention, exact,
        max_logit_diff, error).
    """
    build = build_model or _default_builder(seed)
    rows = []
    for model_type, config in families:
        rows.append(_run_one(model_type, _as_config(model_type, config), build, prompt_lengths,
                             max_new_tokens, seed))
    return rows


def format_markdown(rows: Iterable[Row]) -> str:
    """A Markdown table of :func:`run_matrix` rows (one line per family, trailing newline)."""
    lines = ["| Family | Path | Attention | Exact | Max logit diff | Notes |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        diff = row.get("max_logit_diff")
        diff_text = "n/a" if diff is None else f"{diff:.1e}"
        exact = "yes" if row.get("exact") else "no"
        notes = _cell(row.get("error") or "")
        lines.append(f"| {_cell(row['family'])} | {_cell(row.get('path') or '')} | "
                     f"{_cell(row.get('attention') or '')} | {exact} | {diff_text} | {notes} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ internals
def _cell(text: str) -> str:
    """Text safe inside one Markdown table cell (one line, no column separators), shortened."""
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= 120 else flat[:117] + "..."


def _as_config(model_type: str, config: Any) -> Any:
    if isinstance(config, Mapping):
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **config)
    return config


def _default_builder(seed: int) -> ModelBuilder:
    def build(model_type: str, config: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

    return build


def _prompts(vocab_size: int, pad_id: int, lengths: Sequence[int], seed: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    low = min(3, vocab_size - 1)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(low, vocab_size, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids.to(device), mask.to(device)


def _greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
            pad_id: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:].cpu(), [step.float().cpu() for step in out.logits]


def _compare(ref: torch.Tensor, ref_logits: list[torch.Tensor], got: torch.Tensor,
             got_logits: list[torch.Tensor]) -> tuple[bool, float]:
    """(exact, max abs logit diff over each row's steps up to its first differing token)."""
    exact = ref.shape == got.shape and bool(torch.equal(ref, got))
    worst = 0.0
    steps = min(len(ref_logits), len(got_logits))
    for row in range(ref.shape[0]):
        differ = (ref[row, :steps] != got[row, :steps]).nonzero()
        last = int(differ[0]) if differ.numel() else steps - 1
        for step in range(last + 1):
            worst = max(worst, float((ref_logits[step][row] - got_logits[step][row]).abs().max()))
    return exact, worst


def _run_one(model_type: str, config: Any, build: ModelBuilder, prompt_lengths: Sequence[int],
             max_new_tokens: int, seed: int) -> Row:
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    row: Row = {"family": model_type, "path": family_for(getattr(text_config, "model_type", model_type)).path,
                "attention": None, "exact": False, "max_logit_diff": None, "error": None}
    try:
        model = build(model_type, config)
        pad_id = getattr(text_config, "pad_token_id", None)
        pad_id = 0 if pad_id is None else int(pad_id)
        device = next(model.parameters()).device
        ids, mask = _prompts(int(text_config.vocab_size), pad_id, prompt_lengths, seed, device)
        ref, ref_logits = _greedy(model, ids, mask, max_new_tokens, pad_id)
        patch(model)
        try:
            state = patch_state(model)
            row["path"] = state.family.path if state is not None else row["path"]
            row["attention"] = getattr(model.config, "_attn_implementation", None)
            got, got_logits = _greedy(model, ids, mask, max_new_tokens, pad_id)
        finally:
            unpatch(model)
        row["exact"], row["max_logit_diff"] = _compare(ref, ref_logits, got, got_logits)
    except Exception as exc:  # one family failing must not hide the others
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row
