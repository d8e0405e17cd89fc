"""Implementations of ``flashpage generate`` and ``flashpage demo`` (the README's main job)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

TINY_MODEL_NAME = "flashpage-tiny"  # the built-in model's name (what `flashpage serve` calls it)


def load_model(name: str | None, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) from a path / hub id, or the built-in tiny model when ``name`` is None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashpage.tiny import load_tiny_model

    local = Path(name).expanduser() if name is not None else None
    if name is None or name == TINY_MODEL_NAME:  # the name `flashpage serve` serves it under
        model, tokenizer = load_tiny_model(dtype)
    elif local is not None and local.is_file():
        raise OSError(f"--model {name}: that is a file, not a model; give the checkpoint directory that holds "
                      f"config.json and the weights (e.g. --model {local.parent}) or a hub id")
    elif name.startswith((".", "/", "~")) and not local.is_dir():
        raise OSError(f"--model {name}: no such directory; give a local checkpoint directory or a hub id "
                      "(omit --model for the built-in tiny model)")
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


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
