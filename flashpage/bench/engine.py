"""`flashpage bench engine`: flashpage.LLM vs HF generate() vs HF continuous batching, one process.

All three serve the same seeded requests (random token-id prompts, greedy, EOS ignored, each
request with its own output length) on the same model, all requests submitted at t0:

- flashpage: ``flashpage.LLM(model)``; the bench drives ``add_request`` / ``step`` itself so it can
  read ``LLM.stats()`` after every step (peak blocks in use). TTFT and TPOT come from each
  ``RequestOutput.metrics`` (arrival -> first token; first token -> finish over n - 1 tokens).
- HF generate: ``model.generate()`` (DynamicCache, the model's own attention) on left-padded batches
  of 16 requests in arrival order, each batch run to the batch's longest output, then each request
  cut to its own length; only those tokens count as output. A streamer records the wall time of
  every decoding step, so a request's TTFT is t0 -> its batch's first token (queueing behind the
  earlier batches included) and its TPOT is (time of its own last token - first token) / (n - 1).
  HF generate is the reference: its logits make the comparisons tie-aware.
- HF CB: transformers' continuous batching (``model.continuous_batching_context_manager`` +
  ``manager.add_request(ids, max_new_tokens=n, record_timestamps=True)``), unpatched model, on CPU
  with sdpa attention (``paged|eager`` works too and was not faster here), the same block size and
  pool size as flashpage, no CUDA graphs. TTFT/TPOT from its per-token timestamps.

Peak KV bytes: flashpage = peak blocks in use (``LLM.stats().blocks_used`` read after every step, so
blocks of requests that finish within a step are already freed) x bytes per block; HF generate =
the biggest batch's DynamicCache at the end of that batch; HF CB = its whole cache allocation (it
allocates up front). flashpage and HF CB get the same pool: every request at full length at once.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.bench.models import left_pad, load_bench_model, random_prompts
from flashpage.testing import compare_greedy

HF_BATCH = 16
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 2048
CB_ATTN = "sdpa"
SYSTEMS = ("flashpage", "flashpage_capped", "hf_generate", "hf_cb")
LABELS = {"flashpage": "flashpage.LLM", "flashpage_capped": "flashpage.LLM (16 max)", "hf_generate": "HF generate()",
          "hf_cb": "HF continuous batching"}


WORKLOADS = ("mixed", "shared-prefix", "long-prompt")


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    shared_prefix: int  # tokens every prompt starts with (0: none)
    description: str


def make_workload(name: str, vocab_size: int, quick: bool = False, seed: int = 0) -> Workload:
    """The seeded requests of workload ``name`` ("mixed", "shared-prefix" or "long-prompt": a few 1.5-3k-token
    prompts, where prefill and its attention dominate); ``quick`` shrinks it."""
    gen = torch.Generator().manual_seed(seed + 11)

    def uniform(lo: int, hi: int, n: int) -> list[int]:
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    if name == "mixed":
        n, (plo, phi), (olo, ohi) = (20, (16, 128), (8, 48)) if quick else (48, (32, 256), (16, 128))
        prompts = random_prompts(uniform(plo, phi, n), vocab_size, seed + 12)
        return Workload(name, prompts, uniform(olo, ohi, n), 0,
                        f"{n} requests, prompts uniform in {plo}..{phi} tokens, outputs uniform in {olo}..{ohi}")
    if name == "shared-prefix":
        n, prefix_len, (slo, shi), (olo, ohi) = (20, 128, (8, 32), (8, 32)) if quick \
            else (32, 512, (16, 64), (16, 64))
        prefix = random_prompts([prefix_len], vocab_size, seed + 13)[0]
        own = random_prompts(uniform(slo, shi, n), vocab_size, seed + 14)
        return Workload(name, [prefix + p for p in own], uniform(olo, ohi, n), prefix_len,
                        f"{n} requests sharing a {prefix_len}-token prefix, then {slo}..{shi} own tokens; "
                        f"outputs uniform in {olo}..{ohi}")
    if name == "long-prompt":
        n, (plo, phi), (olo, ohi) = (4, (1536, 3072), (16, 32)) if quick else (8, (1536, 3072), (16, 64))
        prompts = random_prompts(uniform(plo, phi, n), vocab_size, seed + 15)
        return Workload(name, prompts, uniform(olo, ohi, n), 0,
                        f"{n} requests, prompts uniform in {plo}..{phi} tokens, outputs uniform in {olo}..{ohi}")
    raise ValueError(f"unknown workload {name!r}: choose one of {WORKLOADS}")


def _log(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _latency(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90)}


def _tpot(first: float, last: float, n: int) -> float | None:
    return (last - first) / (n - 1) if n > 1 else None


def _warm_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """The untimed warm-up's prompts (every system gets the same): 2048 tokens (``MAX_BATCHED_TOKENS``),
    which both schedulers take in one step, as vLLM's startup runs a dummy step of max_num_batched_tokens:
    the first timed run does not pay for a full-budget step's first-touch memory or oneDNN primitives.
    No prompt is longer than 1000 tokens: that fits every bench model's positions (the built-in model
    has 1024)."""
    lengths = [24, 40, 1000]
    return random_prompts([*lengths, MAX_BATCHED_TOKENS - sum(lengths)], vocab_size, seed + 99)


# ------------------------------------------------------------------------------------------- flashpage
def run_flashpage(model: Any, work: Workload, num_blocks: int, vocab_size: int, seed: int = 0,
                  max_num_seqs: int = 256, block_size: int = BLOCK_SIZE,
                  max_num_batched_tokens: int = MAX_BATCHED_TOKENS, compile: bool = False) -> dict[str, Any]:
    """``compile``: ``LLM(compile=True)``, compiled during the warm-up (``warmup_s``), outside the timed run."""
    from torch._dynamo.utils import counters

    from flashpage.engine import LLM, SamplingParams
    from flashpage.patches import unpatch

    llm = LLM(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=True, compile=compile)
    try:
        warm_start = time.perf_counter()
        llm.generate(_warm_prompts(vocab_size, seed), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        warmup_s = time.perf_counter() - warm_start
        recompiles0 = sum(counters["recompiles"].values())
        bytes_per_block = llm.sizing.bytes_per_token * llm.sizing.block_size
        steps0 = llm.stats().steps
        finished: dict[str, Any] = {}
        peak_blocks = 0
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        ids = [llm.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
               for p, n in zip(work.prompts, work.max_tokens, strict=True)]
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    finished[out.request_id] = out
            peak_blocks = max(peak_blocks, llm.stats().blocks_used)
        elapsed = time.perf_counter() - start
        usage = usage_since(usage0)
        stats = llm.stats()
    finally:
        unpatch(model)
    outs = [finished[i] for i in ids]
    tokens = [list(o.token_ids) for o in outs]
    ttft = [o.metrics.time_to_first_token for o in outs]
    tpot = [t for o in outs if (t := _tpot(o.metrics.first_token_time, o.metrics.finish_time,
                                            len(o.token_ids))) is not None]
    prompt_tokens = sum(len(p) for p in work.prompts)
    cached = sum(o.metrics.cached_prompt_tokens for o in outs)
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "output_tokens": sum(len(t) for t in tokens),
        **_latency(ttft, tpot),
        "peak_kv_bytes": peak_blocks * bytes_per_block,
        "kv_bytes_allocated": llm.kv.allocated_bytes(),
        "peak_blocks_in_use": peak_blocks,
        "num_blocks": stats.blocks_total,
        "block_size": stats.block_size,
        "steps": stats.steps - steps0,
        "preemptions": stats.preemptions,
        "prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "cached_prompt_tokens": cached,
        "engine_hit_rate_incl_warmup": stats.prefix_cache_hit_rate,
        "warmup_s": warmup_s,
        "compiled_steps": stats.compiled_steps,
        "recompiles_after_warmup": sum(counters["recompiles"].values()) - recompiles0,
        "usage": usage,
    }


def run_workload(llm: Any, work: Workload) -> tuple[float, list[list[int]]]:
    """Every request of ``work`` added to ``llm`` at once (greedy, EOS ignored) and stepped to the end:
    the seconds it took and each request's output tokens, in request order."""
    from flashpage.engine import SamplingParams

    start = time.perf_counter()
    ids = [llm.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
           for p, n in zip(work.prompts, work.max_tokens, strict=True)]
    done: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return time.perf_counter() - start, [done[i] for i in ids]


def usage_since(before: resource.struct_rusage) -> dict[str, float]:
    """This process's CPU seconds, involuntary context switches (descheduled while runnable: another
    process wanted the core) and page faults since ``before``: what tells a slow round that computed more
    from one that waited."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": (now.ru_utime - before.ru_utime) + (now.ru_stime - before.ru_stime),
            "involuntary_switches": now.ru_nivcsw - before.ru_nivcsw,
            "minor_faults": now.ru_minflt - before.ru_minflt, "major_faults": now.ru_majflt - before.ru_majflt}


# ----------------------------------------------------------------------------------------- HF generate
class _StepClock:
    """A generate() streamer that only records when each decoding step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


def _hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int,
                 streamer: _StepClock | None = None) -> Any:
    ids, mask = left_pad(prompts, pad_id)
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=pad_id, return_dict_in_generate=True,
                              output_logits=True, streamer=streamer)


def run_hf_generate(model: Any, work: Workload, pad_id: int, vocab_size: int, seed: int = 0) -> dict[str, Any]:
    from flashpage.bench.generate import dense_cache_bytes
    from flashpage.patches import returned_cache

    _hf_generate(model, _warm_prompts(vocab_size, seed), 4, pad_id)
    tokens: list[list[int]] = []
    logits: list[torch.Tensor] = []
    ttft: list[float] = []
    tpot: list[float] = []
    peak_kv = 0
    start = time.perf_counter()
    for b in range(0, len(work.prompts), HF_BATCH):
        prompts, lens = work.prompts[b:b + HF_BATCH], work.max_tokens[b:b + HF_BATCH]
        clock = _StepClock()
        out = _hf_generate(model, prompts, max(lens), pad_id, clock)
        width = max(len(p) for p in prompts)
        peak_kv = max(peak_kv, dense_cache_bytes(returned_cache(out)))
        step_logits = torch.stack(out.logits, dim=1)  # (B, steps, V)
        for j, n in enumerate(lens):
            tokens.append(out.sequences[j, width:width + n].tolist())
            logits.append(step_logits[j, :n].clone())
            ttft.append(clock.times[0] - start)
            if n > 1:
                tpot.append((clock.times[n - 1] - clock.times[0]) / (n - 1))
        del out, step_logits
    elapsed = time.perf_counter() - start
    return {
        "tokens": tokens,
        "logits": logits,
        "seconds": elapsed,
        "output_tokens": sum(len(t) for t in tokens),
        **_latency(ttft, tpot),
        "peak_kv_bytes": peak_kv,
        "batches": math.ceil(len(work.prompts) / HF_BATCH),
        "padded_output_tokens": sum(len(work.max_tokens[b:b + HF_BATCH]) * max(work.max_tokens[b:b + HF_BATCH])
                                    for b in range(0, len(work.prompts), HF_BATCH)),
    }


# ------------------------------------------------------------------------------------------------ HF CB
class CBUnavailable(RuntimeError):
    """transformers' continuous batching cannot run here (this release, this device)."""


def _cb_manager(model: Any, gen_config: Any, num_blocks: int) -> Any:
    """transformers' continuous-batching context manager with flashpage's block size and pool, in the
    spelling of the installed release: a ``ContinuousBatchingConfig`` (``page_size`` since 5.17,
    ``block_size`` before) where it exists, else (5.0-5.x) the same settings on the generation config."""
    import inspect

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:  # the early 5.x API: the cache reads its geometry from the generation config
        gen_config.block_size, gen_config.num_blocks = BLOCK_SIZE, num_blocks
        gen_config.max_batch_tokens, gen_config.use_cuda_graph = MAX_BATCHED_TOKENS, False
        return model.continuous_batching_context_manager(generation_config=gen_config, allow_block_sharing=True)
    fields = inspect.signature(ContinuousBatchingConfig).parameters
    wanted = {"page_size" if "page_size" in fields else "block_size": BLOCK_SIZE, "num_blocks": num_blocks,
              "max_batch_tokens": MAX_BATCHED_TOKENS, "use_cuda_graph": False, "auto_switch_to_flash": False,
              "allow_block_sharing": True}
    cb_config = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})
    return model.continuous_batching_context_manager(generation_config=gen_config,
                                                     continuous_batching_config=cb_config, warmup=True)


def _cb_allocated_bytes(mgr: Any) -> int:
    """Bytes of transformers' paged cache: one ``cache_tensor`` (newer releases) or per-layer K/V lists."""
    cache = mgr.batch_processor.cache if getattr(mgr, "batch_processor", None) is not None else None
    if cache is None:
        return 0
    if isinstance(getattr(cache, "cache_tensor", None), torch.Tensor):
        return int(cache.cache_tensor.nbytes)
    return sum(int(t.nbytes) for name in ("key_cache", "value_cache") for t in getattr(cache, name, []))


def run_hf_cb(model: Any, work: Workload, num_blocks: int, vocab_size: int, seed: int = 0,
              attn: str = CB_ATTN) -> dict[str, Any]:
    from transformers import GenerationConfig

    previous_attn = model.config._attn_implementation
    model.set_attn_implementation(attn)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(work.max_tokens), eos_token_id=-1,
                                  pad_token_id=0)
    results: dict[str, Any] = {}
    try:
        with _cb_manager(model, gen_config, num_blocks) as mgr:
            _cb_collect(mgr, {f"warm{i}": (p, 4) for i, p in enumerate(_warm_prompts(vocab_size, seed))})
            allocated = _cb_allocated_bytes(mgr)
            requests = {f"req{i}": (p, n) for i, (p, n) in enumerate(zip(work.prompts, work.max_tokens, strict=True))}
            start = time.perf_counter()
            results = _cb_collect(mgr, requests)
            elapsed = time.perf_counter() - start
            started = getattr(mgr, "batch_processor", None) is not None
    finally:
        model.set_attn_implementation(previous_attn)
    if not results and not started:  # e.g. 5.0's CB sizes its cache from CUDA memory stats, even on CPU
        import transformers

        raise CBUnavailable(f"transformers {transformers.__version__}'s continuous batching did not start on "
                            f"{model.device.type} (its error is logged above)")
    outs = [results.get(f"req{i}") for i in range(len(work.prompts))]
    failed = [i for i, o in enumerate(outs) if o is None or o.error is not None]
    tokens = [list(o.generated_tokens) if o is not None else [] for o in outs]
    ttft, tpot = [], []
    for o in outs:
        if o is None or not o.timestamps:
            continue
        ttft.append(o.timestamps[0] - o.created_time)
        if (t := _tpot(o.timestamps[0], o.timestamps[-1], len(o.timestamps))) is not None:
            tpot.append(t)
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "output_tokens": sum(len(t) for t in tokens),
        **_latency(ttft, tpot),
        "peak_kv_bytes": allocated,
        "attn_implementation": attn,
        "failed_requests": len(failed),
    }


def _cb_collect(mgr: Any, requests: dict[str, tuple[list[int], int]], timeout: float = 600.0) -> dict[str, Any]:
    for rid, (prompt, n) in requests.items():
        mgr.add_request(prompt, request_id=rid, max_new_tokens=n, record_timestamps=True)
    done: dict[str, Any] = {}
    deadline = time.perf_counter() + timeout
    while len(done) < len(requests) and time.perf_counter() < deadline:
        out = mgr.get_result(timeout=1.0)
        if out is None:
            if not mgr.is_running():
                break
            continue
        if out.is_finished() and out.request_id in requests:
            done[out.request_id] = out
    return done


# ------------------------------------------------------------------------------------------------- run
def _pool_blocks(work: Workload, block_size: int = BLOCK_SIZE) -> int:
    """Blocks for every request at full length at once (+ a little slack): nobody waits for memory."""
    return sum(math.ceil((len(p) + n) / block_size) for p, n in zip(work.prompts, work.max_tokens, strict=True)) + 8


def _agreement(reference: list[list[int]], ref_logits: list[torch.Tensor], got: list[list[int]],
               dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Greedy agreement with the reference; in half precision (``dtype``) a tie is a gap of a rounding step or two."""
    matches = [compare_greedy(r, g, list(lg), dtype=dtype) for r, g, lg in zip(reference, got, ref_logits, strict=True)]
    return {
        "identical_requests": sum(m.identical for m in matches),
        "agreeing_requests": sum(m.ok for m in matches),
        "outputs_identical": all(m.identical for m in matches),
        "outputs_agree": all(m.ok for m in matches),
        "mismatches": [f"request {i}: {m.explain()}" for i, m in enumerate(matches) if not m.identical],
    }


def load_model(model_name: str | None, quick: bool, seed: int, model_shape: str | None = None,
               dtype: str = "bfloat16", num_layers: int | None = None) -> tuple[Any, dict[str, Any] | None]:
    """The bench model (``--model``, or a real shape from flashpage/bench/shapes.py) and, for a shape,
    what the report's header says about it (None otherwise)."""
    if model_shape is None:
        return load_bench_model(model_name, quick=quick, seed=seed), None
    from flashpage.bench.shapes import describe, load_shape_bench_model

    return load_shape_bench_model(model_shape, dtype, num_layers), describe(model_shape, dtype, num_layers)


def run(workload: str = "mixed", model_name: str | None = None, quick: bool = False, seed: int = 0,
        systems: tuple[str, ...] = SYSTEMS, model_shape: str | None = None, dtype: str = "bfloat16",
        num_layers: int | None = None) -> dict[str, Any]:
    """Run the systems on one workload; returns a JSON-friendly dict (see the module docstring).
    ``model_shape``: a real shape (flashpage/bench/shapes.py) in ``dtype`` with ``num_layers``, not ``model_name``."""
    bm, shape = load_model(model_name, quick, seed, model_shape, dtype, num_layers)
    model = bm.model
    work = make_workload(workload, bm.vocab_size, quick=quick, seed=seed)
    pad_id = model.config.pad_token_id if getattr(model.config, "pad_token_id", None) is not None else 0
    num_blocks = _pool_blocks(work)
    _log(f"model: {bm.name}, {bm.parameters / 1e6:.1f}M parameters; workload {workload}: {work.description}")
    if shape is not None:
        from flashpage.bench.shapes import header_line

        _log(header_line(shape))

    raw: dict[str, dict[str, Any]] = {}
    unavailable: dict[str, str] = {}  # system -> why it did not run
    _log("HF generate() (reference)")
    raw["hf_generate"] = run_hf_generate(model, work, pad_id, bm.vocab_size, seed)
    if "hf_cb" in systems:
        _log(f"HF continuous batching ({CB_ATTN})")
        try:
            raw["hf_cb"] = run_hf_cb(model, work, num_blocks, bm.vocab_size, seed)
        except CBUnavailable as exc:
            _log(f"HF continuous batching skipped: {exc}")
            unavailable["hf_cb"] = str(exc)
    if "flashpage" in systems:
        _log("flashpage.LLM")
        raw["flashpage"] = run_flashpage(model, work, num_blocks, bm.vocab_size, seed)
        if workload == "mixed":  # as many sequences in flight as HF generate's batches: like-for-like latency
            _log(f"flashpage.LLM, max_num_seqs={HF_BATCH}")
            raw["flashpage_capped"] = run_flashpage(model, work, num_blocks, bm.vocab_size, seed, HF_BATCH)

    reference, ref_logits = raw["hf_generate"]["tokens"], raw["hf_generate"].pop("logits")
    useful = sum(work.max_tokens)
    result_systems: dict[str, dict[str, Any]] = {}
    for name in SYSTEMS:
        if name not in raw:
            continue
        r = raw[name]
        tokens = r.pop("tokens")
        entry = {"label": LABELS[name], **r, "output_tokens_per_s": r["output_tokens"] / r["seconds"]}
        if name != "hf_generate":
            entry.update(_agreement(reference, ref_logits, tokens, model.dtype))
            entry["lengths_ok"] = [len(t) for t in tokens] == list(work.max_tokens)
        else:
            entry["lengths_ok"] = [len(t) for t in tokens] == list(work.max_tokens)
        result_systems[name] = entry

    fp = result_systems.get("flashpage")
    ratios: dict[str, float] = {}
    if fp is not None:
        for other in ("hf_generate", "hf_cb"):
            if other in result_systems:
                theirs = result_systems[other]["output_tokens_per_s"]
                ratios[f"flashpage_vs_{other}"] = fp["output_tokens_per_s"] / theirs
        hf = result_systems.get("hf_generate")
        capped = result_systems.get("flashpage_capped")
        if hf is not None and hf.get("tpot_p50_s"):
            ratios["tpot_vs_hf_generate"] = fp["tpot_p50_s"] / hf["tpot_p50_s"]
            if capped is not None:
                ratios["capped_vs_hf_generate"] = capped["output_tokens_per_s"] / hf["output_tokens_per_s"]
                ratios["capped_tpot_vs_hf_generate"] = capped["tpot_p50_s"] / hf["tpot_p50_s"]
    goals = _goals(workload, ratios)
    agree = all(s.get("outputs_agree", True) and s["lengths_ok"] for s in result_systems.values())
    return {
        "bench": "engine",
        "workload": workload,
        "workload_description": work.description,
        "quick": quick,
        **bm.run_facts(),
        **({"shape": shape} if shape is not None else {}),
        "requests": len(work.prompts),
        "prompt_tokens": sum(len(p) for p in work.prompts),
        "useful_output_tokens": useful,
        "shared_prefix_tokens": work.shared_prefix,
        "block_size": BLOCK_SIZE,
        "pool_blocks": num_blocks,
        "max_batched_tokens": MAX_BATCHED_TOKENS,
        "hf_batch_size": HF_BATCH,
        "systems": result_systems,
        "unavailable": unavailable,
        "ratios": ratios,
        "goals": goals,
        "outputs_agree": agree,
        "timing_note": "wall clock, one timed run per system after a small warm-up; noisy on a shared CPU",
    }


def _goals(workload: str, ratios: dict[str, float]) -> dict[str, Any]:
    """Throughput ratios flashpage should reach; for mixed also ``tpot_vs_hf_generate`` (time per
    output token p50, flashpage / padded generate(): at most 1)."""
    targets = {"mixed": {"flashpage_vs_hf_generate": 2.0, "flashpage_vs_hf_cb": 3.0},
               "shared-prefix": {"flashpage_vs_hf_generate": 3.0}}.get(workload, {})
    goals: dict[str, Any] = {}
    for key, target in targets.items():
        if key in ratios:
            goals[key] = {"target": target, "measured": ratios[key], "met": ratios[key] >= target}
    for key in ("tpot_vs_hf_generate", "capped_tpot_vs_hf_generate"):
        if workload == "mixed" and key in ratios:
            goals[key] = {"target": 1.0, "measured": ratios[key], "met": ratios[key] <= 1.0}
    return goals


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f}"


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for :func:`run`'s result."""
    from flashpage.bench.shapes import header_line

    lines = [
        f"bench engine, workload {result['workload']}: {result['workload_description']}",
        f"model: {result['model']} ({result['parameters'] / 1e6:.1f}M params, {result['dtype']}, {result['device']}, "
        f"{result['threads']} threads, load avg {result['load_average_1m']}{', quick' if result['quick'] else ''}); "
        "greedy, EOS ignored; "
        f"{result['prompt_tokens']} prompt tokens, {result['useful_output_tokens']} output tokens",
        *([header_line(result["shape"])] if result.get("shape") else []),
        f"block size {result['block_size']}, pool {result['pool_blocks']} blocks (flashpage and HF CB), "
        f"{result['max_batched_tokens']} tokens per step at most; HF generate in batches of {result['hf_batch_size']}",
        "",
        f"{'system':<24}{'tok/s':>8}{'seconds':>9}{'TTFT p50':>11}{'TTFT p90':>11}{'TPOT p50':>11}{'TPOT p90':>11}"
        f"{'peak KV':>12}   outputs vs HF generate",
    ]
    for name, s in result["systems"].items():
        if name == "hf_generate":
            agree = "(reference)"
        else:
            agree = (f"{s['identical_requests']}/{result['requests']} identical, "
                     f"{s['agreeing_requests']}/{result['requests']} agree (tie-aware)")
        lat = "".join(f"{_ms(s[k]) + ' ms':>11}" for k in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s"))
        lines.append(f"{s['label']:<24}{s['output_tokens_per_s']:>8.1f}{s['seconds']:>9.2f}{lat}"
                     f"{s['peak_kv_bytes'] / 2**20:>8.1f} MiB   {agree}")
    for name, why in result.get("unavailable", {}).items():
        lines.append(f"{LABELS[name]:<24}not run: {why}")
    fp = result["systems"].get("flashpage")
    if fp is not None:
        lines += ["", f"flashpage: {fp['steps']} steps, peak {fp['peak_blocks_in_use']} of {fp['num_blocks']} blocks "
                      f"in use, {fp['preemptions']} preemptions, prefix cache hit rate "
                      f"{fp['prefix_cache_hit_rate']:.1%} ({fp['cached_prompt_tokens']} of {result['prompt_tokens']} "
                      "prompt tokens)"]
    hg = result["systems"].get("hf_generate")
    if hg is not None:
        lines.append(f"HF generate: {hg['batches']} batches, {hg['padded_output_tokens']} tokens generated for "
                     f"{result['useful_output_tokens']} useful")
    for s in result["systems"].values():
        for m in s.get("mismatches", []):
            lines.append(f"  {s['label']}: {m}")
    if result["ratios"]:
        lines += ["", "ratios (output tokens/s; tpot: time per output token p50): " + ", ".join(
            f"{k.replace('_vs_', ' / ')} = {v:.2f}x" for k, v in result["ratios"].items())]
    if result["goals"]:
        lines.append("goals:")
        for k, g in result["goals"].items():
            op = "<=" if "tpot" in k else ">="
            lines.append(f"  {k.replace('_vs_', ' / ')} {op} {g['target']:g}x: {'met' if g['met'] else 'NOT met'} "
                         f"({g['measured']:.2f}x)")
    lines.append(f"outputs agree: {'yes' if result['outputs_agree'] else 'NO'}   ({result['timing_note']})")
    return "\n".join(lines)
