"""``flashpage demo``: transformers, patched ``generate()`` and ``flashpage.LLM`` on the same prompts.

Runs offline on the built-in tiny model by default. Reports the generated text, whether the
three agree token for token (a difference is accepted only at a reference tie, see
:mod:`flashpage.testing`), KV memory of the paged cache against the dense one, and throughput.
"""

from __future__ import annotations

from typing import Any

import torch

from flashpage.commands import DEMO_PROMPTS, load_model, timed
from flashpage.testing import compare_greedy

MAX_NEW = 48


def _hf_generate(model: Any, batch: dict[str, torch.Tensor], pad_id: int) -> tuple[list[list[int]], Any]:
    out = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, pad_token_id=pad_id)
    width = batch["input_ids"].shape[1]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    tokens = []
    for row in out.sequences[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        tokens.append(row[:cut])
    return tokens, out


def demo(model_name: str | None = None) -> dict[str, Any]:
    """Run the comparison and return a JSON-friendly report."""
    from flashpage.engine import LLM, SamplingParams
    from flashpage.patches import patch, returned_cache, unpatch

    model, tok = load_model(model_name)
    tok.padding_side = "left"
    batch = tok(DEMO_PROMPTS, return_tensors="pt", padding=True)
    (ref, ref_out), t_hf = timed(_hf_generate, model, batch, tok.pad_token_id)
    logits = [torch.stack([step[i] for step in ref_out.logits]) for i in range(len(DEMO_PROMPTS))]

    patch(model)
    (got, got_out), t_patched = timed(_hf_generate, model, batch, tok.pad_token_id)
    mem = returned_cache(got_out).memory_stats()  # .cache or .past_key_values, by release
    unpatch(model)

    llm = LLM(model, tok, max_num_seqs=len(DEMO_PROMPTS))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    llm_out, t_llm = timed(llm.generate, DEMO_PROMPTS, params, use_tqdm=False)
    unpatch(model)

    gen_ok = [compare_greedy(r, g, lg) for r, g, lg in zip(ref, got, logits, strict=True)]
    llm_ok = [compare_greedy(r, o.token_ids, lg) for r, o, lg in zip(ref, llm_out, logits, strict=True)]
    new_tokens = sum(len(r) for r in ref)
    return {
        "model": model_name or "built-in tiny model",
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(next(model.parameters()).device),
        "samples": [{"prompt": p, "text": o.text} for p, o in zip(DEMO_PROMPTS, llm_out, strict=True)],
        "identical_generate": all(m.ok for m in gen_ok),
        "identical_llm": all(m.ok for m in llm_ok),
        "mismatches": [m.explain() for m in gen_ok + llm_ok if not m.identical],
        "batch": len(DEMO_PROMPTS),
        "dense_kv_bytes": mem.dense_bytes,
        "paged_kv_bytes": mem.bytes_in_use,
        "kv_saving": mem.saving,
        "tokens_stored": mem.tokens_stored,
        "block_size": mem.block_size,
        "tok_s_hf": new_tokens / t_hf,
        "tok_s_patched": new_tokens / t_patched,
        "tok_s_llm": sum(len(o.token_ids) for o in llm_out) / t_llm,
    }
