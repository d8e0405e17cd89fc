"""`flashpage bench spec --model-shape NAME`: speculative decoding on a real model shape (random weights).

The target is a registry shape (:mod:`flashpage.bench.shapes`, e.g. Qwen3-0.6B's widths, heads and 151936-token
vocabulary) with ``--num-layers`` of its layers, in ``--dtype``, saved once and loaded with ``from_pretrained``.
Two speculative methods run against it, each beside the same target without speculation (``bench spec``'s
workloads, alternating runs):

- ``ngram``: prompt lookup (``--speculative-config``, default ``bench spec``'s);
- ``draft``: a draft model of the same family: the target's own first ``--draft-layers`` layers with its
  embedding, final norm and LM head (``from_pretrained(path, num_hidden_layers=D)``: the same checkpoint cut
  short, an early-exit draft). With random weights the later layers are not refinements of the early ones, so
  this draft's acceptance is what it is (near zero: the report says so); it measures what a draft costs on a
  real shape and that speculation switches itself off when proposals fail. A trained checkpoint's early
  layers agree far more often; random weights cannot show that.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

DEFAULT_LAYERS = 8
DEFAULT_DRAFT_LAYERS = 2


def load_pair(name: str, dtype: str, num_layers: int, draft_layers: int) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(target, draft, tokenizer, shape info): the saved shape with ``num_layers`` layers and its first
    ``draft_layers`` layers (+ embedding, final norm, LM head) as the draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashpage.bench.shapes import DTYPES, describe, dtype_name, load_shape_bench_model, saved_shape

    if not 1 <= draft_layers < num_layers:
        raise ValueError(f"--draft-layers {draft_layers}: give 1 to {num_layers - 1} (fewer than the target's "
                         f"{num_layers} layers)")
    target = load_shape_bench_model(name, dtype, num_layers).model
    path = saved_shape(name, dtype, num_layers)
    draft = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype_name(dtype)],
                                                 num_hidden_layers=draft_layers).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    info = {**describe(name, dtype, num_layers), "draft_layers": draft_layers,
            "draft_parameters": sum(p.numel() for p in draft.parameters())}
    return target, draft, tok, info


def run_shape(name: str, dtype: str, num_layers: int, draft_layers: int, batches: list[int], max_tokens: int,
              threads: int, spec_config: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Every workload at every batch size, for n-gram and the early-exit draft, each against no speculation."""
    import torch

    from flashpage import LLM
    from flashpage.bench.spec import WORKLOADS, measure

    torch.set_num_threads(threads)
    target, draft, tok, info = load_pair(name, dtype, num_layers, draft_layers)
    k = int(spec_config["num_speculative_tokens"])
    configs = {"ngram": spec_config, "draft": {"model": draft, "num_speculative_tokens": k}}
    common = {"max_num_seqs": max(batches), "kv_cache_memory": 256 << 20, "max_model_len": 1024}
    base = LLM(target, tok, **common)
    rows = []
    for method, config in configs.items():
        spec = LLM(target, tok, speculative_config=config, **common)
        for workload in WORKLOADS:
            for batch in batches:
                rows.append({"method": method, **asdict(measure(workload, batch, max_tokens, base, spec, tok,
                                                                repeats))})
        del spec
    shown = {"ngram": spec_config, "draft": {"model": f"first {draft_layers} layers of the target",
                                             "num_speculative_tokens": k}}
    return {"model": f"{name} shape, random weights", "shape": info, "threads": threads, "max_tokens": max_tokens,
            "repeats": repeats, "speculative_configs": shown, "torch": torch.__version__, "rows": rows,
            "timing_note": "alternating runs on a shared host; fastest of each kept"}


def format_report(result: dict[str, Any]) -> str:
    from flashpage.bench.shapes import header_line
    from flashpage.bench.spec import FIGURES_HEADER, row_figures

    info = result["shape"]
    lines = [f"flashpage bench spec --model-shape: {header_line(info)}; draft: its first {info['draft_layers']} "
             f"layers + final norm + LM head ({info['draft_parameters'] / 1e6:.1f}M params); "
             f"{result['threads']} thread(s), {result['max_tokens']} output tokens, best of {result['repeats']}",
             f"{'method':<7}{'workload':<9}{'batch':>6}{FIGURES_HEADER}"]
    lines += [f"{r['method']:<7}{r['workload']:<9}{r['batch']:>6}{row_figures(r)}" for r in result["rows"]]
    return "\n".join(lines)
