"""`flashpage bench breakdown`: where an engine step's time goes, from ``torch.profiler``.

Runs the ``bench engine`` workload (mixed or shared-prefix; block size 128 as ``--against vllm``;
prefix caching off, since the profiled run repeats the unprofiled one's requests) through
``flashpage.LLM`` once unprofiled (the wall time) and once under ``torch.profiler.profile`` with
labelled regions (``record_function``) wrapped around, for the profiled run only:

- **linears**: every ``nn.Linear`` forward (q/k/v/o, gate/up/down, LM head);
- **attention**: the registered attention function and the paged cache's ``update`` (K/V store);
- **norms / rotary / activations**: ``*RMSNorm`` / ``*LayerNorm`` modules, the rotary embedding
  module and ``apply_rotary_pos_emb``, the MLP's ``act_fn`` and the rest of the MLP's elementwise ops;
- **sampler**: ``LLM.sampler``; **scheduler + input building**: ``Scheduler.schedule`` and ``kv.plan``
  / ``set_plan``;
- **other ops**: torch ops outside these regions (embedding, residual adds, input tensors, logits
  slicing, mask building).

Each op's self CPU time goes to the innermost label above it. **Python** is what is left of the
profiled wall time once every op's self time is counted: the interpreter between ops (module calls,
hooks, the engine's bookkeeping). The profiler adds a cost per op, so the shares, not the absolute
profiled times, are the result; the unprofiled wall time is reported beside them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flashpage.bench.engine import MAX_BATCHED_TOKENS, _pool_blocks, _warm_prompts, make_workload, run_workload
from flashpage.bench.models import load_average

CATEGORIES = ("linears", "attention", "norms/rotary/activations", "sampler", "scheduler + inputs", "other ops",
              "python")
_LABELS = {"fp::linear": "linears", "fp::attention": "attention", "fp::norm": "norms/rotary/activations",
           "fp::rotary": "norms/rotary/activations", "fp::act": "norms/rotary/activations",
           "fp::sampler": "sampler", "fp::schedule": "scheduler + inputs"}


def _labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def _module_label(name: str, module: torch.nn.Module) -> str | None:
    cls = type(module).__name__
    if isinstance(module, torch.nn.Linear):
        return "fp::linear"
    if cls.endswith(("RMSNorm", "LayerNorm")):
        return "fp::norm"
    if "Rotary" in cls:
        return "fp::rotary"
    if name.endswith("act_fn") or cls.endswith("MLP"):
        return "fp::act"  # an MLP's own ops are its activation and gating products (its linears nest inside)
    return None


@contextlib.contextmanager
def labelled_regions(llm: Any) -> Iterator[None]:
    """Wrap the model's modules and the engine's parts in ``record_function`` labels; undone on exit."""
    from transformers import AttentionInterface

    from flashpage.patches import ATTN_NAME, HFPagedCache
    from flashpage.plan import DeviceStep

    undo: list[Callable[[], None]] = []

    def swap(obj: Any, attr: str, label: str) -> None:
        old = getattr(obj, attr)
        had_own = attr in vars(obj)
        setattr(obj, attr, _labelled(label, old))
        undo.append(lambda: setattr(obj, attr, old) if had_own else delattr(obj, attr))

    for name, module in llm.model.named_modules():
        label = _module_label(name, module)
        if label is not None:
            swap(module, "forward", label)
    attn = AttentionInterface._global_mapping[ATTN_NAME]
    AttentionInterface.register(ATTN_NAME, _labelled("fp::attention", attn))
    undo.append(lambda: AttentionInterface.register(ATTN_NAME, attn))
    swap(HFPagedCache, "update", "fp::attention")
    swap(DeviceStep, "attend", "fp::attention")  # the flat eager step calls it directly
    rotary_fns = []
    for mod in list(sys.modules.values()):
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if getattr(mod, "__name__", "").startswith("transformers.models.") and callable(fn):
            rotary_fns.append((mod, fn))
    for mod, fn in rotary_fns:
        mod.apply_rotary_pos_emb = _labelled("fp::rotary", fn)
        undo.append(functools.partial(setattr, mod, "apply_rotary_pos_emb", fn))
    swap(llm, "sampler", "fp::sampler")
    swap(llm.scheduler, "schedule", "fp::schedule")
    swap(llm.kv, "plan", "fp::schedule")
    swap(llm._cache, "set_plan", "fp::schedule")
    undo += _relabelled_flat_step(llm)
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _relabelled_flat_step(llm: Any) -> list[Callable[[], None]]:
    """Rebuild the engine's verified flat eager step (engine/flat.py) on the labelled module forwards: it binds
    each module's ``forward`` when built, so the one in use calls the unlabelled ones. Returns its undo."""
    from flashpage.engine.flat import FlatDecoder, flat_decoder

    old = getattr(llm, "_flat", None)
    if old is None or not old.usable():
        return []
    new = flat_decoder(llm.model)
    if not isinstance(new, FlatDecoder) or new.modules != old.modules:
        raise RuntimeError(f"bench breakdown: the flat eager step could not be rebuilt on labelled modules ({new})")
    new.options, new.verified = old.options, True  # the same modules, now behind record_function labels
    llm._flat = new
    return [lambda: setattr(llm, "_flat", old)]


def attribute(events: Any, wall_us: float) -> dict[str, float]:
    """Microseconds per category: each event's self CPU time to its innermost label; python = the rest."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for evt in events:
        if evt.name in _LABELS or evt.name.startswith("ProfilerStep") or evt.name.startswith("fp::"):
            continue
        parent, category = evt.cpu_parent, "other ops"
        while parent is not None:
            if parent.name in _LABELS:
                category = _LABELS[parent.name]
                break
            parent = parent.cpu_parent
        totals[category] += evt.self_cpu_time_total
    totals["python"] = max(wall_us - sum(totals.values()), 0.0)
    return totals


def _engine_run(llm: Any, work: Any) -> tuple[float, int, int]:
    """One run of ``work``: seconds, engine steps, output tokens."""
    steps0 = llm.stats().steps
    seconds, tokens = run_workload(llm, work)
    return seconds, llm.stats().steps - steps0, sum(map(len, tokens))


def run(workload: str = "mixed", model_name: str | None = None, quick: bool = False, seed: int = 0,
        block_size: int = 128, vllm_python: str | None = None, model_shape: str | None = None,
        dtype: str = "bfloat16", num_layers: int | None = None) -> dict[str, Any]:
    """Profile one run of the workload; returns the per-category times and shares (and vLLM's, from
    ``vllm_runner.py`` under ``vllm_python``, on the same model, requests and settings). ``model_shape``: a real
    shape (flashpage/bench/shapes.py) in ``dtype`` with ``num_layers``, not ``model_name``."""
    from flashpage.bench.engine import load_model
    from flashpage.engine import LLM, SamplingParams
    from flashpage.patches import unpatch

    bm, _ = load_model(model_name, quick, seed, model_shape, dtype, num_layers)
    work = make_workload(workload, bm.vocab_size, quick=quick, seed=seed)
    llm = LLM(bm.model, block_size=block_size, num_blocks=_pool_blocks(work, block_size),
              max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=False)
    try:
        llm.generate(_warm_prompts(bm.vocab_size, seed), SamplingParams(max_tokens=4, temperature=0.0,
                                                                        ignore_eos=True), use_tqdm=False)
        plain_s, steps, generated = _engine_run(llm, work)
        with labelled_regions(llm), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            _engine_run(llm, work)
            profiled_s = time.perf_counter() - start
    finally:
        unpatch(bm.model)
    totals = attribute(prof.events(), profiled_s * 1e6)
    vllm = _vllm_breakdown(vllm_python, bm, work, block_size, seed) if vllm_python else None
    return {"vllm": vllm, "bench": "breakdown", "workload": workload, "workload_description": work.description,
            "model": bm.name,
            "dtype": str(next(bm.model.parameters()).dtype).removeprefix("torch."), "quick": quick,
            "threads": torch.get_num_threads(), "load_average_1m": load_average(),
            "prefix_caching": False, "steps": steps, "output_tokens": generated, "wall_s": plain_s,
            "profiled_wall_s": profiled_s, "ms_per_step": plain_s / steps * 1e3,
            "categories": {k: {"profiled_ms": v / 1e3, "share": v / (profiled_s * 1e6)} for k, v in totals.items()},
            "outputs_agree": True}


def _vllm_breakdown(python: str, bm: Any, work: Any, block_size: int, seed: int) -> dict[str, Any]:
    """vLLM's profiled run on the same model and requests (prefix caching off, as here)."""
    import tempfile
    from pathlib import Path

    from flashpage.bench import vs_vllm

    version = vs_vllm.check_vllm_python(python)
    settings = vs_vllm.Settings(enable_prefix_caching=False, block_size=block_size, threads=torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="flashpage-breakdown-") as tmp:
        model_dir = str(Path(tmp) / "model")
        bm.model.save_pretrained(model_dir)
        max_len = vs_vllm.workload_max_model_len(bm, work, block_size, seed)
        spec = vs_vllm.make_spec(bm, work, settings, model_dir, _pool_blocks(work, block_size), max_len, seed,
                                 profile=True)
        out = vs_vllm.run_vllm(python, spec, Path(tmp))
    wall_us = out["seconds"] * 1e6
    return {"version": version, "profiled_wall_s": out["seconds"], "output_tokens": out["output_tokens"],
            "categories": {k: {"profiled_ms": v / 1e3, "share": v / wall_us} for k, v in out["categories_us"].items()}}


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for :func:`run`'s result."""
    vllm = result.get("vllm")
    lines = [f"bench breakdown, flashpage.LLM, workload {result['workload']}: {result['workload_description']}",
             f"model: {result['model']}; {result['threads']} thread(s), load avg {result['load_average_1m']}; "
             f"{result['steps']} steps, {result['output_tokens']} output tokens, {result['wall_s']:.2f} s unprofiled "
             f"({result['ms_per_step']:.1f} ms/step), {result['profiled_wall_s']:.2f} s profiled",
             f"{'part of the step':<28}{'share':>8}{'profiled ms':>14}" + (
                 f"{'vLLM share':>12}{'vLLM ms':>10}" if vllm else "")]
    for name, c in result["categories"].items():
        theirs = vllm["categories"][name] if vllm else None
        lines.append(f"{name:<28}{c['share']:>8.1%}{c['profiled_ms']:>14.0f}" + (
            f"{theirs['share']:>12.1%}{theirs['profiled_ms']:>10.0f}" if theirs else ""))
    if vllm:
        lines.append(f"vLLM {vllm['version']}: {vllm['profiled_wall_s']:.2f} s profiled for {vllm['output_tokens']} "
                     "output tokens (engine in-process, its model compiled by inductor: its fused kernels count as "
                     "norms/rotary/activations)")
    return "\n".join(lines)
