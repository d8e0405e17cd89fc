"""Run one offline vLLM measurement; executed by vLLM's own interpreter, never imported by flashpage.

    VLLM_PYTHON flashpage/bench/vllm_runner.py SPEC.json OUT.json

SPEC (written by ``flashpage bench engine --against vllm``): ``model`` (a checkpoint directory),
``prompts`` (token ids), ``max_tokens`` (one per prompt), ``warm_prompts``, and the engine settings
``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``block_size``, ``dtype``,
``kv_cache_memory_bytes``, ``max_model_len``, ``threads``. Every request is greedy with EOS ignored
and submitted at once (``LLM.generate``); only that call is timed, after a warm-up ``generate``.
OUT gets ``tokens`` (per request), ``seconds``, ``output_tokens``, ``vllm_version`` and the
settings vLLM resolved. A SPEC with ``cases`` (``flashpage bench spec --against vllm``) is run by
:func:`measure_cases` instead. This file imports only the standard library and vLLM, so it runs in a
virtual environment that does not have flashpage.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _threads_env(threads: int) -> None:
    """Pin vLLM's OpenMP threads to the first ``threads`` cores (as flashpage runs ``threads``)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


# (class path, method, label): labelled regions for ``profile`` (the engine in this process)
_REGIONS = (("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "vl::schedule"),
            ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", "vl::schedule"),
            ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "vl::model"),
            ("vllm.v1.sample.sampler", "Sampler", "forward", "vl::sampler"))
_LINEAR_OPS = ("mm", "addmm", "linear", "matmul", "bmm", "gemm", "onednn", "mkldnn", "dnnl")


def _label_regions() -> None:
    import functools
    import importlib

    import torch

    for module, cls_name, method, label in _REGIONS:
        cls = getattr(importlib.import_module(module), cls_name)
        fn = getattr(cls, method)

        def wrapper(*args, _fn=fn, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _fn(*args, **kwargs)
        setattr(cls, method, functools.wraps(fn)(wrapper))


def _category(name: str, region: str | None) -> str:
    low = name.lower()
    if region == "vl::sampler":
        return "sampler"
    if region == "vl::schedule":
        return "scheduler + inputs"
    linear = any(op in low.split("::")[-1] for op in _LINEAR_OPS)
    if region == "vl::model":
        if "attention" in low or "attn" in low or "paged" in low:
            return "attention"
        if linear:
            return "linears"
        return "norms/rotary/activations"  # what else runs in the model: fused elementwise kernels
    return "linears" if linear else "other ops"  # the LM head runs after the model's forward (compute_logits)


def _attribute(events, wall_us: float) -> dict:
    """Self CPU time per category (innermost vl:: label); the model region's own time (compiled
    kernels that the profiler does not name, guards) counts as norms/rotary/activations; python =
    wall time left over."""
    totals = {k: 0.0 for k in ("linears", "attention", "norms/rotary/activations", "sampler",
                               "scheduler + inputs", "other ops", "python")}
    for evt in events:
        if evt.name.startswith("ProfilerStep"):
            continue
        if evt.name.startswith("vl::"):
            child_time = sum(c.cpu_time_total for c in evt.cpu_children)
            own = max(evt.cpu_time_total - child_time, 0.0)
            if evt.name == "vl::model":
                totals["norms/rotary/activations"] += own
            continue
        region, parent = None, evt.cpu_parent
        while parent is not None:
            if parent.name.startswith("vl::"):
                region = parent.name
                break
            parent = parent.cpu_parent
        totals[_category(evt.name, region)] += evt.self_cpu_time_total
    totals["python"] = max(wall_us - sum(totals.values()), 0.0)
    return totals


def measure(spec: dict) -> dict:
    """Load vLLM on ``spec['model']``, warm up, time one ``generate`` of every request (``profile``:
    the engine in this process, the timed call under torch.profiler with labelled regions)."""
    _threads_env(int(spec["threads"]))
    profile = bool(spec.get("profile"))
    if profile:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _label_regions()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=spec["enable_prefix_caching"], block_size=spec["block_size"],
              kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], max_model_len=spec["max_model_len"],
              skip_tokenizer_init=True, seed=0)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["warm_prompts"]], params(4), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    categories = None
    if profile:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            outs = llm.generate(prompts, [params(n) for n in spec["max_tokens"]], use_tqdm=False)
            seconds = time.perf_counter() - start
        categories = _attribute(prof.events(), seconds * 1e6)
    else:
        start = time.perf_counter()
        outs = llm.generate(prompts, [params(n) for n in spec["max_tokens"]], use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens": tokens, "seconds": seconds, "output_tokens": sum(len(t) for t in tokens),
            "peak_rss": _peak_rss(),
            "categories_us": categories,
            "vllm_version": vllm.__version__,
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")}


def measure_cases(spec: dict) -> dict:
    """``flashpage bench spec --against vllm``: one vLLM engine (``spec['speculative_config']`` when given, e.g.
    n-gram) over several ``cases`` (``name``, ``prompts``, ``max_tokens``, ``temperature``, ``seed``): each
    generated once untimed, then ``repeats`` times timed (the fastest kept), with vLLM's speculation counters
    (``vllm:spec_decode_*``) over all its runs."""
    _threads_env(int(spec["threads"]))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"speculative_config": spec["speculative_config"]} if spec.get("speculative_config") else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              enable_prefix_caching=spec["enable_prefix_caching"], block_size=spec["block_size"],
              kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], max_model_len=spec["max_model_len"],
              skip_tokenizer_init=True, seed=0, disable_log_stats=False, **extra)
    cases = []
    for case in spec["cases"]:
        params = SamplingParams(temperature=case["temperature"], seed=case.get("seed"), max_tokens=case["max_tokens"],
                                ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
        before = _spec_counters(llm)
        best, tokens = float("inf"), []
        for i in range(1 + int(spec.get("repeats", 1))):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            if i:  # the first run warms up
                best = min(best, time.perf_counter() - start)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        after = _spec_counters(llm)
        cases.append({"name": case["name"], "tokens": tokens, "seconds": best,
                      "output_tokens": sum(len(t) for t in tokens),
                      "spec": {k: after.get(k, 0) - before.get(k, 0) for k in after}})
    return {"cases": cases, "vllm_version": vllm.__version__, "omp_threads_bind": os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND"), "speculative_config": spec.get("speculative_config")}


def _spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far: drafts (proposals), draft_tokens, accepted_tokens."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and getattr(metric, "value", None) is not None:
            out[metric.name[len("vllm:spec_decode_num_"):]] = metric.value
    return out


def _peak_rss() -> int:
    """Bytes: this process's peak resident set plus its largest child's (vLLM's engine core process), so
    the in-process and the multiprocess engine count alike."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return kib * 1024


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_runner.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    result = measure_cases(spec) if "cases" in spec else measure(spec)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM's engine starts worker processes: the guard is required
    here = os.path.dirname(os.path.abspath(__file__))  # flashpage/bench/ must not shadow anything vLLM imports
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main(sys.argv))
