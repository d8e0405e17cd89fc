"""``flashpage bench memory``: peak resident memory of running one model, side by side.

Each case runs in a fresh process (so one case's allocations never count for another) that loads the
checkpoint with ``from_pretrained`` as a user would and runs the same greedy requests:

- ``transformers``: unpatched batched ``generate()`` (its dynamic cache), the floor to compare with;
- ``flashpage-generate``: ``flashpage.patch(model)`` and the same ``generate()`` on the paged cache;
- ``flashpage-llm``: ``flashpage.LLM(path)`` with a KV pool of ``--kv-cache-memory`` bytes;
- ``flashpage-serve``: ``flashpage serve`` (its HTTP front and its engine process) with the same pool and
  settings, the requests sent by this process as token ids to ``/v1/completions`` (all at once), so the
  client is not in the measured tree; its texts are compared with transformers' tokens decoded;
- ``vllm`` (``--vllm-python PATH``): vLLM's offline ``LLM`` with the same pool, in its own interpreter
  (``bench/vllm_runner.py``).

The parent samples the resident set of each case's whole process tree (vLLM and ``flashpage serve`` start
an engine process) every 20 ms and reports its peak, beside the checkpoint's weight bytes and the KV pool, and
``overhead = peak - weights - pool`` (the interpreter, imports, activations and allocator slack
included; for ``LLM`` on float32 weights, its oneDNN-packed copies less what paging out the originals of a
file-backed checkpoint released: the report prints both). The model is a saved real-shape checkpoint
(``--model-shape``, default Qwen3-0.6B's config) or ``--model PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CASES = ("transformers", "flashpage-generate", "flashpage-llm", "flashpage-serve")
SERVE = "flashpage-serve"
POLL_S = 0.02


@dataclass(frozen=True)
class MemoryWorkload:
    """The requests every case runs: greedy, EOS ignored (token ids drawn from the vocabulary, seed 0)."""

    num_requests: int = 8
    prompt_len: int = 128
    max_tokens: int = 32
    kv_cache_memory: int = 256 << 20
    block_size: int = 16

    def prompts(self, vocab_size: int) -> list[list[int]]:
        import random

        rng = random.Random(0)
        return [[rng.randrange(10, vocab_size) for _ in range(self.prompt_len - 4 * i)]
                for i in range(self.num_requests)]


@dataclass
class CaseResult:
    case: str
    peak: int  # bytes: the largest resident set of the case's process tree seen
    pool: int  # bytes of KV the case reserved (0: transformers' dynamic cache, counted in the peak)
    seconds: float
    tokens: list[list[int]]
    error: str = ""
    packed: int = 0  # bytes of LLM's oneDNN-packed weight copies (in the peak)
    released: int = 0  # bytes the resident set shrank by when LLM paged out the packed GEMMs' original weights
    texts: list[str] = field(default_factory=list)  # flashpage-serve: the completions' texts (no token ids)


# ---------------------------------------------------------------------------------------------- children
def _child(case: str, model_dir: str, workload: MemoryWorkload) -> dict[str, Any]:
    """Run ``case`` in this (fresh) process; what it generated and the KV pool it held."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    start = time.perf_counter()
    if case == "flashpage-llm":
        from flashpage import LLM, SamplingParams

        llm = LLM(model_dir, kv_cache_memory=workload.kv_cache_memory, block_size=workload.block_size,
                  max_num_seqs=workload.num_requests, device="cpu")
        prompts = workload.prompts(int(llm.model.config.vocab_size))
        outs = llm.generate(prompts, SamplingParams(max_tokens=workload.max_tokens, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        pool = llm.kv.bytes_per_block() * llm.kv.num_blocks
        packs = llm._prepack
        return {"tokens": tokens, "pool": pool, "seconds": time.perf_counter() - start,
                "packed": packs.nbytes() if packs is not None else 0,
                "released": packs.released() if packs is not None else 0}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    prompts = workload.prompts(int(model.config.vocab_size))
    if case == "flashpage-generate":
        import flashpage

        flashpage.patch(model)
    tokens, pool = _batched_generate(model, prompts, workload.max_tokens)
    return {"tokens": tokens, "pool": pool, "seconds": time.perf_counter() - start}


def _batched_generate(model: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """One left-padded greedy ``generate()`` of every prompt: the new tokens and the paged pool's bytes (0 for
    transformers' own cache)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    kv = getattr(out.past_key_values, "kv", None)
    pool = kv.bytes_per_block() * kv.num_blocks if kv is not None else 0
    return out.sequences[:, width:].tolist(), pool


# ----------------------------------------------------------------------------------------------- parent
def _tree_rss(pid: int) -> int:
    """Bytes: the resident sets of ``pid`` and its descendants added up, less any child that is a fork not yet
    turned into its program (its command line still its parent's): until it execs, such a child's resident pages
    are its parent's (``subprocess`` starts a child by vfork or fork, then exec), and counting them again would
    report the parent twice for that moment (``flashpage serve`` starting its engine process). A worker forked
    without exec that kept its parent's command line would be missed: no case starts one (vLLM's processes are
    spawned or renamed)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            parent = p.parent() if p.pid != pid else None
            if parent is not None and p.cmdline() == parent.cmdline():
                continue
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _child_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1"}


@dataclass
class _PeakSampler:
    """The largest resident set of ``pid``'s process tree, sampled every :data:`POLL_S` on a thread."""

    pid: int
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _tree_rss(self.pid))
            self._stop.wait(POLL_S)


@contextlib.contextmanager
def _sampled(pid: int) -> Iterator[_PeakSampler]:
    sampler = _PeakSampler(pid)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        yield sampler
    finally:
        sampler._stop.set()
        thread.join()


def _watch(cmd: list[str], out_path: Path, timeout: float) -> tuple[int, str]:
    """Run ``cmd``, sampling its process tree's RSS: (peak bytes, the tail of its output)."""
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env())
        with _sampled(child.pid) as sampler:
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        log.seek(0)
        return sampler.peak, log.read()[-3000:]


def _serve_case(model_dir: str, workload: MemoryWorkload, timeout: float) -> CaseResult:
    """``flashpage serve`` on ``model_dir`` with the workload's pool and settings, its process tree sampled from
    its start; every request sent at once from this process (outside the tree), non-streamed."""
    import httpx

    from flashpage.bench.serve import started_server
    from flashpage.serve.ports import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "flashpage.cli", "serve", "--model", model_dir, "--port", str(port),
           "--log-level", "warning", "--device", "cpu", "--kv-cache-memory", str(workload.kv_cache_memory),
           "--block-size", str(workload.block_size), "--max-num-seqs", str(workload.num_requests)]
    prompts = _checkpoint_prompts(model_dir, workload)
    samplers: list[_PeakSampler] = []
    with contextlib.ExitStack() as stack:
        start = time.perf_counter()
        try:
            url = stack.enter_context(started_server(
                cmd, port, env=_child_env(), replace_env=True, timeout=timeout,
                on_spawn=lambda pid: samplers.append(stack.enter_context(_sampled(pid)))))

            def complete(prompt: list[int]) -> dict[str, Any]:
                body = {"model": model_dir, "prompt": prompt, "max_tokens": workload.max_tokens,
                        "temperature": 0.0, "ignore_eos": True}
                reply = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
                reply.raise_for_status()
                return reply.json()

            with ThreadPoolExecutor(len(prompts)) as pool:
                replies = list(pool.map(complete, prompts))
        except (RuntimeError, httpx.HTTPError) as exc:
            return CaseResult(SERVE, samplers[0].peak if samplers else 0, 0, 0.0, [], error=str(exc))
        seconds = time.perf_counter() - start
    texts = [r["choices"][0]["text"] for r in replies]
    counts = [int(r["usage"]["completion_tokens"]) for r in replies]
    if counts != [workload.max_tokens] * len(prompts):
        return CaseResult(SERVE, samplers[0].peak, 0, seconds, [], error=f"completion tokens {counts}, asked for "
                          f"{workload.max_tokens} each")
    return CaseResult(SERVE, samplers[0].peak, workload.kv_cache_memory, seconds, [], texts=texts)


def run_case(case: str, model_dir: str, workload: MemoryWorkload, vllm_python: str | None = None,
             timeout: float = 1800.0) -> CaseResult:
    if case == SERVE:
        return _serve_case(model_dir, workload, timeout)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        if case == "vllm":
            cmd = [str(vllm_python), str(Path(__file__).with_name("vllm_runner.py")),
                   str(_vllm_spec(model_dir, workload, Path(tmp))), str(out)]
        else:
            cmd = [sys.executable, "-m", "flashpage.bench.memory", case, model_dir, json.dumps(asdict(workload)),
                   str(out)]
        peak, tail = _watch(cmd, out, timeout)
        if not out.is_file():
            return CaseResult(case, peak, 0, 0.0, [], error=tail)
        got = json.loads(out.read_text())
    pool = workload.kv_cache_memory if case == "vllm" else int(got["pool"])
    return CaseResult(case, peak, pool, float(got["seconds"]), got["tokens"], packed=int(got.get("packed", 0)),
                      released=int(got.get("released", 0)))


def _checkpoint_prompts(model_dir: str, workload: MemoryWorkload) -> list[list[int]]:
    """The workload's prompts for the checkpoint's vocabulary (read from its config, no weights loaded)."""
    from transformers import AutoConfig

    return workload.prompts(int(AutoConfig.from_pretrained(model_dir).vocab_size))


def _vllm_spec(model_dir: str, workload: MemoryWorkload, tmp: Path) -> Path:
    prompts = _checkpoint_prompts(model_dir, workload)
    spec = {"model": model_dir, "prompts": prompts, "max_tokens": [workload.max_tokens] * len(prompts),
            "warm_prompts": [prompts[0][:8]], "max_num_seqs": workload.num_requests,
            "max_num_batched_tokens": 2048, "enable_prefix_caching": True, "block_size": 128, "dtype": "auto",
            "kv_cache_memory_bytes": workload.kv_cache_memory, "max_model_len": 2048, "threads": 1}
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def checkpoint_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's weight files (``*.safetensors`` / ``*.bin``): what a loaded model holds."""
    folder = Path(model_dir)
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))


def _build_kernels() -> None:
    """Build (or find) the C++ CPU kernels here first: a case that built them itself would count the compiler's
    memory in its process tree."""
    from flashpage.kernels import cpu_attention, cpu_fused

    cpu_attention.load()
    cpu_fused.load()


def run(model_dir: str, workload: MemoryWorkload, vllm_python: str | None = None,
        cases: tuple[str, ...] = CASES) -> dict[str, Any]:
    """Every case in turn; each row with peak, pool, overhead and whether its tokens equal transformers'."""
    weights = checkpoint_bytes(model_dir)
    _build_kernels()
    results = [run_case(c, model_dir, workload) for c in cases]
    if vllm_python:
        results.append(run_case("vllm", model_dir, workload, vllm_python))
    ref = next((r.tokens for r in results if r.case == "transformers" and not r.error), None)
    ref_texts = _decoded(model_dir, ref) if ref is not None and SERVE in cases else None
    rows = []
    for r in results:
        same = r.texts == ref_texts if r.case == SERVE else r.tokens == ref  # the server answers with text
        rows.append({"case": r.case, "peak": r.peak, "weights": weights, "pool": r.pool,
                     "overhead": r.peak - weights - r.pool, "seconds": round(r.seconds, 2),
                     "tokens_equal_transformers": None if ref is None or r.error else same,
                     "packed": r.packed, "released": r.released, "error": r.error})
    return {"model": model_dir, "workload": asdict(workload), "rows": rows, "dtype": _checkpoint_dtype(model_dir)}


def _decoded(model_dir: str, tokens: list[list[int]]) -> list[str]:
    """Each token list as the server's text of it (special tokens skipped, the server's default)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]


def _checkpoint_dtype(model_dir: str) -> str:
    """The checkpoint's dtype name from its config.json ("float32" when it says none)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def format_report(result: dict[str, Any]) -> str:
    mib = 2 ** 20
    w = result["workload"]
    lines = [f"model: {result['model']} ({result.get('dtype', '?')})",
             f"workload: {w['num_requests']} greedy requests, prompts {w['prompt_len'] - 4 * (w['num_requests'] - 1)}"
             f"-{w['prompt_len']} tokens, {w['max_tokens']} new each; one thread; peak = the process tree's "
             "largest resident set (sampled every 20 ms)",
             f"{'case':<20} {'peak MiB':>9} {'weights':>8} {'KV pool':>8} {'overhead':>9} {'seconds':>8}  tokens"]
    for r in result["rows"]:
        if r["error"]:
            last = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
            lines.append(f"{r['case']:<20} failed: {last}")
            continue
        half = result.get("dtype") in ("bfloat16", "float16")  # batched half-precision GEMMs change tokens
        differ = "differ from transformers (half precision: no token contract)" if half else "DIFFER from transformers"
        same = {None: "-", True: "= transformers", False: differ}[r["tokens_equal_transformers"]]
        lines.append(f"{r['case']:<20} {r['peak'] / mib:>9.0f} {r['weights'] / mib:>8.0f} {r['pool'] / mib:>8.1f} "
                     f"{r['overhead'] / mib:>9.0f} {r['seconds']:>8.1f}  {same}")
    lines += [f"{r['case']}: oneDNN-packed weight copies {r['packed'] / mib:.0f} MiB (in the overhead), original "
              f"weights paged out after packing {r['released'] / mib:.0f} MiB (out of the weights)"
              for r in result["rows"] if r.get("packed") and not r["error"]]
    return "\n".join(lines)


def run_cli(args: Any) -> int:
    """``flashpage bench memory``: the report (or JSON); exit 1 when a case failed."""
    from flashpage.bench.shapes import saved_shape

    if args.model is not None and args.model_shape is not None:
        raise ValueError("give --model or --model-shape, not both")
    model_dir = args.model or str(saved_shape(args.model_shape or "qwen3-0.6b", args.dtype or "bfloat16",
                                              args.num_layers))
    workload = MemoryWorkload(num_requests=4, prompt_len=64, max_tokens=8) if args.quick else MemoryWorkload()
    if args.kv_cache_memory is not None:
        workload = MemoryWorkload(**{**asdict(workload), "kv_cache_memory": args.kv_cache_memory})
    result = run(model_dir, workload, args.vllm_python)
    from flashpage.bench.record import dumps

    print(dumps(result) if args.json else format_report(result))
    return 1 if any(r["error"] for r in result["rows"]) else 0


def _main(argv: list[str]) -> int:
    case, model_dir, workload, out = argv
    result = _child(case, model_dir, MemoryWorkload(**json.loads(workload)))
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
