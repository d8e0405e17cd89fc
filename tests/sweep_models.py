"""The causal-LM sweep: every type of the installed transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
patched ``generate()`` and ``flashpage.LLM`` each against unpatched ``generate()``.

Per type (config from :mod:`sweep_configs`, float32, random weights): a left-padded batch of two
prompts, 12 greedy tokens, EOS off.

- ``generate``: patched greedy ``generate()`` on the batch against the unpatched one on the same
  model (tokens equal, or first differing at a reference tie; logits within 1e-4 up to there);
- ``llm``: ``LLM.generate`` of both prompts (each as its own request, logprobs on) against the
  unpatched ``generate()`` of each prompt alone (tokens as above; the chosen token's and the top
  logprobs within 1e-4 of the reference's log-softmax).

Each path's outcome is ``exact``, ``refused`` (``UnsupportedModelError`` with its reason: allowed),
``silent`` (ran, but differs) or ``crash`` (another exception, a timeout, a dead worker); a type
whose unpatched model cannot be built or run here is ``unbuildable``. Types run in worker
processes (imports shared within a worker, a per-type timeout; a worker that hangs or dies is
replaced).

Command (writes the JSON and README's support matrix)::

    python tests/sweep_models.py --workers 2 --json sweep.json --readme

``--update sweep.json TYPE...`` re-sweeps only the named types and keeps the other rows.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
README = HERE.parent / "docs" / "models.md"  # the page that holds the generated matrix
PROMPT_LENGTHS = (7, 4)
MAX_NEW_TOKENS = 12
LOGIT_ATOL = 1e-4
TIE_TOL = 1e-5
TOP_LOGPROBS = 5
DEFAULT_TIMEOUT = 240.0
OUTCOMES = ("exact", "refused", "unbuildable", "crash", "silent")
ALLOWED = ("exact", "refused", "unbuildable")
MATRIX_START, MATRIX_END = "<!-- sweep-matrix:start -->", "<!-- sweep-matrix:end -->"


@dataclass
class PathResult:
    """One path's (generate or LLM) outcome for one type."""

    outcome: str
    detail: str = ""
    max_diff: float | None = None


@dataclass
class TypeResult:
    """One model type's sweep row."""

    model_type: str
    generate: PathResult
    llm: PathResult
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        """The worse of the two paths (crash > silent > unbuildable > refused > exact)."""
        order = {"crash": 4, "silent": 3, "unbuildable": 2, "refused": 1, "exact": 0}
        return max((self.generate.outcome, self.llm.outcome), key=order.__getitem__)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "outcome": self.outcome}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TypeResult:
        return cls(data["model_type"], PathResult(**data["generate"]), PathResult(**data["llm"]),
                   data.get("seconds", 0.0), list(data.get("notes", [])))


# ---------------------------------------------------------------------------------- one type
def _quiet() -> None:
    import warnings

    warnings.simplefilter("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()


def build_model(model_type: str) -> Any:
    """The sweep's float32 random-weight model of ``model_type`` (embeddings / LM head widened
    as tests/model_zoo.py does, so greedy decoding rarely meets a tie)."""
    import torch
    from sweep_configs import PAD, sweep_config
    from transformers import AutoModelForCausalLM

    config = sweep_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and ("lm_head" in name or "embed" in name or "wte" in name):
                p.mul_(4.0)
    if hasattr(model, "set_default_language"):  # X-MOD: adapters per language
        model.set_default_language(next(iter(model.config.languages)))
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None  # 12 tokens always, and no EOS masking in the reference
    model.config.eos_token_id = None  # nor in LLM (which falls back to the config's): no ignore_eos needed, so
    # generation_config processors that act at the last token (forced_eos_token_id) apply in both
    return model.eval()


def _prompts(vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, min(vocab, 99), (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _greedy(model: Any, prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[Any]]:
    """Unpadded-left-padded greedy generate: (new tokens per row, per-step logits (B, V) float)."""
    import torch
    from sweep_configs import PAD

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, pad_token_id=PAD,
                             return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[:, width:].tolist()
    return tokens, [step.float() for step in out.logits]


def _compare_tokens(ref: list[int], got: list[int], ref_logits: list[Any]) -> tuple[bool, int, str]:
    """(ok, steps to compare logits over, explanation): equal, or first differing at a reference tie."""
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            top = ref_logits[i].topk(2).values
            gap = float(top[0] - top[1])
            if gap <= TIE_TOL:
                return True, i + 1, ""
            return False, i + 1, f"token {i} differs ({b} instead of {a}; reference top-2 gap {gap:.3g})"
    if len(ref) != len(got):
        return False, min(len(ref), len(got)), f"{len(got)} tokens instead of {len(ref)}"
    return True, len(ref), ""


def _check_generate(model: Any, prompts: list[list[int]], ref: tuple[list[list[int]], list[Any]]) -> PathResult:
    from flashpage.patches import UnsupportedModelError, patch, unpatch

    try:
        patch(model)
    except UnsupportedModelError as exc:
        return PathResult("refused", str(exc))
    try:
        tokens, logits = _greedy(model, prompts)
    finally:
        unpatch(model)
    ref_tokens, ref_logits = ref
    worst, problems = 0.0, []
    for row in range(len(prompts)):
        ok, steps, why = _compare_tokens(ref_tokens[row], tokens[row], [s[row] for s in ref_logits])
        if not ok:
            problems.append(f"row {row}: {why}")
        for step in range(min(steps, len(logits))):
            worst = max(worst, float((ref_logits[step][row] - logits[step][row]).abs().max()))
    if worst > LOGIT_ATOL:
        problems.append(f"max |logit diff| {worst:.3g}")
    return PathResult("silent" if problems else "exact", "; ".join(problems), worst)


def _check_llm(model: Any, prompts: list[list[int]], refs: list[tuple[list[list[int]], list[Any]]]) -> PathResult:
    from flashpage import LLM, SamplingParams
    from flashpage.patches import UnsupportedModelError

    try:
        llm = LLM(model, block_size=4, num_blocks=64, max_num_seqs=4, compile=False)
    except UnsupportedModelError as exc:
        return PathResult("refused", str(exc))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=TOP_LOGPROBS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    worst, problems = 0.0, []
    for row, (out, (ref_tokens, ref_logits)) in enumerate(zip(outputs, refs, strict=True)):
        steps_logits = [s[0] for s in ref_logits]
        ok, steps, why = _compare_tokens(ref_tokens[0], list(out.token_ids), steps_logits)
        if not ok:
            problems.append(f"row {row}: {why}")
        for step in range(min(steps, len(out.logprobs or []))):
            ref_lp = steps_logits[step].log_softmax(-1)
            got = out.logprobs[step]
            diffs = [abs(got.logprob - float(ref_lp[out.token_ids[step]]))]
            diffs += [abs(lp - float(ref_lp[tok])) for tok, lp in got.top.items()]
            worst = max(worst, *diffs)
    if worst > LOGIT_ATOL:
        problems.append(f"max |logprob diff| {worst:.3g}")
    return PathResult("silent" if problems else "exact", "; ".join(problems), worst)


def _crash(exc: BaseException) -> PathResult:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return PathResult("crash", f"{type(exc).__name__}: {exc}{where}")


def run_type(model_type: str) -> TypeResult:
    """Sweep one type in this process."""
    import torch

    _quiet()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        model = build_model(model_type)
        vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        prompts = _prompts(vocab)
        ref = _greedy(model, prompts)
        singles = [_greedy(model, [p]) for p in prompts]
    except Exception as exc:  # not flashpage's: the unpatched model does not build or run here
        bad = PathResult("unbuildable", _crash(exc).detail)
        return TypeResult(model_type, bad, bad, time.perf_counter() - start)
    results = []
    for check in (lambda: _check_generate(model, prompts, ref), lambda: _check_llm(model, prompts, singles)):
        try:
            results.append(check())
        except Exception as exc:
            results.append(_crash(exc))
        _ensure_unpatched(model)
    return TypeResult(model_type, results[0], results[1], time.perf_counter() - start)


def _ensure_unpatched(model: Any) -> None:
    from flashpage.patches import is_patched, unpatch

    if is_patched(model):
        unpatch(model)


def _special(model_type: str) -> TypeResult | None:
    """Types the runner's own tests use: ``__sleep__`` hangs, ``__exit__`` kills its worker."""
    if model_type == "__sleep__":
        time.sleep(3600)
    if model_type == "__exit__":
        os._exit(3)
    return None


# ----------------------------------------------------------------------------------- workers
def worker_main() -> None:
    """Read type names from stdin, write one JSON result per line on the original stdout."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the models' prints must not corrupt results
    sys.path.insert(0, str(HERE))
    import sweep_configs  # noqa: F401  (imported once per worker, before any type's clock starts)
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    import flashpage.engine  # noqa: F401

    _quiet()
    out.write("ready\n")
    for line in sys.stdin:
        model_type = line.strip()
        if not model_type:
            continue
        result = _special(model_type) or run_type(model_type)
        out.write(json.dumps(result.to_json()) + "\n")


@dataclass
class _Worker:
    proc: subprocess.Popen
    model_type: str | None = None
    deadline: float = 0.0
    buffer: bytes = b""
    ready: bool = False


def _start_worker() -> _Worker:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=str(HERE.parent))
    os.set_blocking(proc.stdout.fileno(), False)
    return _Worker(proc)


def _failed(model_type: str, why: str, seconds: float) -> TypeResult:
    crash = PathResult("crash", why)
    return TypeResult(model_type, crash, crash, seconds)


def run_sweep(types: Iterable[str], workers: int = 2, timeout: float = DEFAULT_TIMEOUT,
              progress: Any = None) -> list[TypeResult]:
    """Sweep ``types`` over ``workers`` processes, ``timeout`` seconds per type at most.

    Returns one result per type, in input order. A type whose worker hangs past the timeout or dies
    is a ``crash`` (the worker is replaced)."""
    queue = list(types)
    order = {t: i for i, t in enumerate(queue)}
    results: dict[str, TypeResult] = {}
    pool = [_start_worker() for _ in range(max(1, min(workers, len(queue))))]
    selector = selectors.DefaultSelector()
    for w in pool:
        selector.register(w.proc.stdout, selectors.EVENT_READ, w)
    try:
        while len(results) < len(order):
            for w in pool:
                if w.ready and w.model_type is None and queue:
                    w.model_type, w.deadline = queue.pop(0), time.monotonic() + timeout
                    w.proc.stdin.write((w.model_type + "\n").encode())
                    w.proc.stdin.flush()
            for key, _ in selector.select(timeout=1.0):
                w = key.data
                chunk = w.proc.stdout.read() or b""
                w.buffer += chunk
                while b"\n" in w.buffer:
                    line, w.buffer = w.buffer.split(b"\n", 1)
                    if line == b"ready":
                        w.ready = True
                        continue
                    result = TypeResult.from_json(json.loads(line))
                    results[result.model_type] = result
                    w.model_type = None
                    if progress:
                        progress(result)
            for i, w in enumerate(pool):
                dead = w.proc.poll() is not None
                late = w.model_type is not None and time.monotonic() > w.deadline
                if dead and not w.ready:
                    raise RuntimeError(f"a sweep worker failed to start (exit code {w.proc.returncode})")
                if w.model_type is None or not (dead or late):
                    continue
                why = f"timeout after {timeout:.0f} s" if late and not dead else \
                    f"worker died (exit code {w.proc.returncode})"
                results[w.model_type] = _failed(w.model_type, why, timeout if late else 0.0)
                if progress:
                    progress(results[w.model_type])
                selector.unregister(w.proc.stdout)
                w.proc.kill()
                w.proc.wait()
                pool[i] = _start_worker()
                selector.register(pool[i].proc.stdout, selectors.EVENT_READ, pool[i])
    finally:
        for w in pool:
            if w.proc.poll() is None:
                w.proc.stdin.close()
                w.proc.kill()
                w.proc.wait()
    return sorted(results.values(), key=lambda r: order[r.model_type])


def all_types() -> list[str]:
    """Every type of the installed transformers' causal-LM mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ------------------------------------------------------------------------------------ README
def _short(text: str, limit: int = 110) -> str:
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _reason(path: PathResult) -> str:
    """The refusal's reason (what follows 'cannot be exact:' / the first sentence), for the table."""
    text = path.detail
    if " exactly: " in text:
        text = text.split(" exactly: ", 1)[1]
    elif "): " in text:
        text = text.split("): ", 1)[1]
    return _short(text.strip())


def summary(results: Sequence[TypeResult]) -> dict[str, int]:
    counts = {k: 0 for k in OUTCOMES}
    for r in results:
        counts[r.outcome] += 1
    return counts


def readme_table(results: Sequence[TypeResult]) -> str:
    """README's support matrix: a summary line and one row per type (outcomes and reasons only,
    nothing that varies between runs)."""
    import transformers

    counts = summary(results)
    both = sum(r.generate.outcome == "exact" and r.llm.outcome == "exact" for r in results)
    gen_only = sum(r.generate.outcome == "exact" and r.llm.outcome == "refused" for r in results)
    lines = [f"transformers {transformers.__version__}, {len(results)} causal-LM types: exact in `generate()` and "
             f"`LLM` {both}; exact in `generate()`, refused by `LLM` {gen_only}; refused by both "
             f"{counts['refused'] - gen_only}; unbuildable here {counts['unbuildable']}; crash {counts['crash']}; "
             f"silent {counts['silent']}.", "",
             "| Type | `generate()` | `LLM` | Why not (refusal reason) |", "|---|---|---|---|"]
    for r in results:
        why = next((_reason(p) for p in (r.generate, r.llm) if p.outcome != "exact"), "")
        lines.append(f"| {r.model_type} | {r.generate.outcome} | {r.llm.outcome} | {why} |")
    return "\n".join(lines) + "\n"


def marked_section(text: str, start: str, end: str) -> str:
    """The generated part of a docs page: what stands between its ``start`` and ``end`` markers."""
    if start not in text or end not in text:
        raise ValueError(f"{README.name} lacks the {start} / {end} markers")
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def write_marked(page: Path, start: str, end: str, body: str) -> None:
    """Replace what stands between ``page``'s ``start`` and ``end`` markers with ``body``."""
    head, rest = page.read_text().split(start, 1)
    page.write_text(f"{head}{start}\n{body}{end}{rest.split(end, 1)[1]}")


def readme_section(text: str) -> str:
    """The generated part of README (between the sweep-matrix markers)."""
    return marked_section(text, MATRIX_START, MATRIX_END)


def write_readme(results: Sequence[TypeResult], readme: Path = README) -> None:
    write_marked(readme, MATRIX_START, MATRIX_END, readme_table(results))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per type")
    parser.add_argument("--json", type=Path, help="write the per-type results here")
    parser.add_argument("--readme", action="store_true", help="rewrite README's support matrix")
    parser.add_argument("--update", type=Path, help="a previous run's JSON: sweep only the given types, keep the rest")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return 0
    types = args.types or all_types()

    def show(r: TypeResult) -> None:
        bad = next((p.detail for p in (r.generate, r.llm) if p.outcome != "exact"), "")
        print(f"{r.model_type:28s} {r.generate.outcome:11s} {r.llm.outcome:11s} {r.seconds:5.1f}s {_short(bad, 150)}",
              flush=True)

    results = run_sweep(types, args.workers, args.timeout, progress=show)
    if args.update:
        fresh = {r.model_type: r for r in results}
        old = [TypeResult.from_json(row) for row in json.loads(args.update.read_text())]
        results = [fresh.get(r.model_type, r) for r in old] + [r for t, r in fresh.items()
                                                                if t not in {o.model_type for o in old}]
    print(json.dumps(summary(results)))
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    if args.readme:
        write_readme(results)
    return 0 if all(r.outcome in ALLOWED for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
