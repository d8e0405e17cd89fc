"""Implementations of ``flashpage generate`` and ``flashpage demo`` (README.md's main job)."""

from __future__ import annotations

import json
import time
from typing import Any

import torch


def load_model(name: str | None, dtype: torch.dtype | str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) for ``--model name`` (None: the built-in model), in the checkpoint's dtype
    unless ``dtype`` is given, on CUDA when torch sees a GPU (:mod:`flashpage.engine.loading`)."""
    from flashpage.engine import loading

    return loading.load_model(name, dtype=dtype, label=f"--model {name}")


def run_generate(model: str | None, prompt: str, max_tokens: int, temperature: float, stream: bool,
                 seed: int | None) -> int:
    """Print a completion of ``prompt`` from the patched model (streamed token by token if asked)."""
    from flashpage.engine import LLM, SamplingParams

    hf_model, tokenizer = load_model(model)
    llm = LLM(hf_model, tokenizer, max_num_seqs=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    if stream:
        print(prompt, end="", flush=True)
        for delta in llm.stream(prompt, params):
            print(delta.text, end="", flush=True)
        print()
        return 0
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    print(prompt + out.text)
    return 0


DEMO_PROMPTS = [
    "The list",
    "Return the number of",
    "This module provides",
    "If the file",
    "The default value is",
    "Raise an exception",
    "The dictionary is a mutable mapping from keys to values. A key must be hashable; the values may be "
    "any object. When the same key is used again, the old value is replaced. To remove an entry, use the",
]


def run_demo(model: str | None, as_json: bool = False) -> int:
    """Patched generate() and LLM side by side with unpatched transformers on the same prompts."""
    from flashpage.demo import demo

    report = demo(model)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(format_demo(report))
    return 0 if report["identical_generate"] and report["identical_llm"] else 1


def format_demo(report: dict[str, Any]) -> str:
    lines = [f"model: {report['model']}  ({report['parameters'] / 1e6:.1f}M parameters, {report['device']})", ""]
    for row in report["samples"]:
        lines.append(f"> {row['prompt']}{row['text']}")
    lines += [
        "",
        f"patched generate() == transformers generate(): {report['identical_generate']}",
        f"flashpage.LLM       == transformers generate(): {report['identical_llm']}",
        "",
        "KV memory (batch of {batch}, left-padded):".format(batch=report["batch"]),
        f"  dense cache (transformers): {report['dense_kv_bytes'] / 1024:.1f} KiB",
        f"  flashpage pages in use:     {report['paged_kv_bytes'] / 1024:.1f} KiB "
        f"({_times(report['kv_saving'])}; real tokens {report['tokens_stored']}, block size {report['block_size']})",
        "",
        "throughput (new tokens/s):",
        f"  transformers generate(): {report['tok_s_hf']:.0f}",
        f"  patched generate():      {report['tok_s_patched']:.0f}",
        f"  flashpage.LLM:           {report['tok_s_llm']:.0f}",
    ]
    return "\n".join(lines)


def _times(saving: float) -> str:
    """'1.52x less' when the pages are smaller than the dense cache, '1.25x more' otherwise."""
    return f"{saving:.2f}x less" if saving >= 1 else f"{1 / saving:.2f}x more"


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start
