"""The image sweep: every type of the installed transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` and
``MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES``, patched ``generate()`` and ``flashpage.LLM`` with image prompts against
unpatched ``generate()``.

Per type (:func:`vlm_zoo.sweep_image_case`: float32, tiny random weights):

- ``image`` (generate()): a left-padded batch of two prompts with one image each, greedy, a few new tokens, EOS
  off; tokens equal (or first differing at a reference tie) and every step's logits within 1e-4. The same prompts
  with other images must change the unpatched logits (else the row says the image has no effect: the comparison
  would prove nothing about images);
- ``llm`` (only where ``image`` is exact, else ``not-run``): each of the two prompts alone, unpadded, as an image
  request in one ``flashpage.LLM`` (``{"prompt_token_ids": ids, "multi_modal_data": {"image": tensors}}`` with the
  case's processor outputs or hand-built tensors; greedy, the same new tokens, logprobs; 4-token blocks, a 16-token
  step budget so chunks end inside the image blocks, or 2048 where LLM refuses a prompt or a two-way span longer
  than that), against unpatched generate() of that prompt alone (batch of one, taken before LLM patches the model):
  tokens as above, the chosen and top tokens' logprobs within 1e-4 of the reference's log-softmax. Image
  placeholder ids the tiny config leaves outside its vocabulary are moved inside first (LLM's steps embed them).

Outcomes (as tests/sweep_models.py): ``exact``; ``refused`` (flashpage's ``UnsupportedModelError`` from patch(),
generate() or ``LLM(model)``, or LLM's ``ValueError`` when a request with images is added, before any output);
``unbuildable`` (no image prompt or no unpatched run here: the reason says why); ``silent`` (ran, differs: a bug);
``crash`` (another exception, a timeout, a dead worker: a bug). Types run in worker processes with a per-type
timeout (the causal-LM sweep's runner).

Command (writes the JSON and docs/models.md's image matrix)::

    python tests/sweep_vlm.py --workers 2 --readme
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sweep_models as sm

HERE = Path(__file__).resolve().parent
MAX_NEW_TOKENS = 4
EFFECT_ATOL = 1e-3  # the other images must move some logit by more than this
DEFAULT_TIMEOUT = 90.0
MATRIX_START, MATRIX_END = "<!-- vlm-matrix:begin -->", "<!-- vlm-matrix:end -->"
LLM_OUTCOMES = ("exact", "refused", "not-run", "silent", "crash")
LLM_ALLOWED = ("exact", "refused", "not-run")


NOT_RUN = sm.PathResult("not-run", "generate() with images is not exact here")


@dataclass
class VlmResult:
    """One type's row: ``image`` is patched vs unpatched generate() with images; ``llm`` is ``flashpage.LLM`` with
    the same image prompts (each alone) vs unpatched generate() of each (``not-run`` where ``image`` is not exact);
    ``effect`` whether other images change the unpatched output (None: not measured)."""

    model_type: str
    image: sm.PathResult
    llm: sm.PathResult = field(default_factory=lambda: NOT_RUN)
    how: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    effect: bool | None = None

    def __init__(self, model_type: str, image: sm.PathResult, llm: sm.PathResult | None = None,
                 seconds: float = 0.0, notes: list[str] | None = None, how: str = "",
                 effect: bool | None = None) -> None:
        # (model_type, path, path, seconds): the runner's own crash rows (sweep_models._failed) build it so
        self.model_type, self.image, self.llm, self.seconds = model_type, image, llm or NOT_RUN, seconds
        self.notes, self.how, self.effect = list(notes or []), how, effect

    @property
    def outcome(self) -> str:
        """generate()'s outcome with images (the LLM column is read from ``llm``)."""
        return self.image.outcome

    def to_json(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "image": asdict(self.image), "llm": asdict(self.llm), "how": self.how,
                "effect": self.effect, "seconds": self.seconds, "notes": self.notes, "outcome": self.outcome}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VlmResult:
        llm = sm.PathResult(**data["llm"]) if data.get("llm") else None
        return cls(data["model_type"], sm.PathResult(**data["image"]), llm, data.get("seconds", 0.0),
                   data.get("notes"), data.get("how", ""), data.get("effect"))


# ---------------------------------------------------------------------------------- one type
def _generate(model: Any, inputs: dict[str, Any]) -> tuple[list[list[int]], list[Any]]:
    import torch

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    width = inputs["input_ids"].shape[1]
    return out.sequences[:, width:].tolist(), [step.float() for step in out.logits]


def _compare(ref: tuple[list[list[int]], list[Any]], got: tuple[list[list[int]], list[Any]]) -> sm.PathResult:
    (ref_tokens, ref_logits), (tokens, logits) = ref, got
    worst, problems = 0.0, []
    for row in range(len(ref_tokens)):
        ok, steps, why = sm._compare_tokens(ref_tokens[row], tokens[row], [s[row] for s in ref_logits])
        if not ok:
            problems.append(f"row {row}: {why}")
        for step in range(min(steps, len(logits))):
            worst = max(worst, float((ref_logits[step][row] - logits[step][row]).abs().max()))
    if worst > sm.LOGIT_ATOL:
        problems.append(f"max |logit diff| {worst:.3g}")
    return sm.PathResult("silent" if problems else "exact", "; ".join(problems), worst)


def _effect(ref: tuple[list[list[int]], list[Any]], other: tuple[list[list[int]], list[Any]]) -> bool:
    return any(float((a - b).abs().max()) > EFFECT_ATOL for a, b in zip(ref[1], other[1], strict=False))


def _refused_anyway(model: Any) -> sm.PathResult | None:
    """Where no image prompt is built: patch()'s refusal of the model itself (it refuses it whatever the prompt),
    else None. A refusal from its failed test forward counts only where the unpatched model runs a text prompt
    here (else the refusal only repeats what the unpatched model does here too: fail)."""
    import torch

    from flashpage.patches import UnsupportedModelError, patch, unpatch

    if model is None:
        return None
    try:
        patch(model)
    except UnsupportedModelError as exc:
        refusal = sm.PathResult("refused", str(exc))
    except Exception:  # judged on an image prompt only
        return None
    else:
        unpatch(model)
        return None
    if "test forward" not in refusal.detail:  # refused for what the model is (encoder-decoder, cross-attention...)
        return refusal
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6]]), attention_mask=torch.ones(1, 4, dtype=torch.long))
    except Exception:
        return None
    return refusal


# --------------------------------------------------------------------------- LLM with images
LLM_BUDGET = 16  # max_num_batched_tokens: chunk boundaries fall inside the image blocks
LLM_WIDE_BUDGET = 2048  # where a prompt or a two-way span must be computed in one step (LLM refuses it under 16)
LLM_BLOCK = 4


def prompt_alone(batch: dict[str, Any], i: int) -> tuple[list[int], dict[str, Any]]:
    """Row ``i`` of a left-padded sweep batch alone: its unpadded ids and its image tensors (M-RoPE models'
    flattened patches split by ``image_grid_thw``, per-token tensors unpadded, the others sliced)."""
    import torch

    mask = batch["attention_mask"][i].bool()
    tensors: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
            continue
        if key == "pixel_values" and "image_grid_thw" in batch:
            sizes = batch["image_grid_thw"].prod(-1).tolist()
            tensors[key] = value[sum(sizes[:i]):sum(sizes[:i + 1])]
        elif value.shape == batch["input_ids"].shape:
            tensors[key] = value[i][mask][None]
        else:
            tensors[key] = value[i:i + 1]
    return batch["input_ids"][i][mask].tolist(), tensors


def _alone(model: Any, ids: list[int], tensors: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """Unpatched greedy generate() of one prompt (batch of one, no padding): (new tokens, per-step log-softmax)."""
    import torch

    from flashpage.patches import is_patched

    assert not is_patched(model), "the reference must be taken on the unpatched model"
    input_ids = torch.tensor([ids])
    tokens, logits = _generate(model, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                                       **tensors})
    return tokens[0], [step[0].log_softmax(-1) for step in logits]


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in the environment inside the block, the previous values back after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _llm_outputs(model: Any, requests: list[dict[str, Any]], budget: int, max_len: int) -> list[Any]:
    """The requests through one ``flashpage.LLM`` (greedy, logprobs, EOS ignored); the model unpatched after.
    A ``max_len`` past the model's ``max_position_embeddings`` (Janus' tiny config says 512 for a 583-token
    prompt; plain RoPE) is allowed through the engine's own override, as the unpatched generate() runs it."""
    from flashpage import LLM, SamplingParams
    from flashpage.engine.llm import ALLOW_LONG_MAX_MODEL_LEN

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=sm.TOP_LOGPROBS, ignore_eos=True)
    blocks = len(requests) * -(-(max_len + 1) // LLM_BLOCK) + 2
    positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    allow = {ALLOW_LONG_MAX_MODEL_LEN: "1"} if isinstance(positions, int) and max_len > positions else {}
    with _environ(allow):
        llm = LLM(model, block_size=LLM_BLOCK, num_blocks=blocks, max_num_batched_tokens=budget, max_model_len=max_len,
                  max_num_seqs=len(requests), compile=False)
    try:
        return llm.generate(requests, params, use_tqdm=False)
    finally:
        sm._ensure_unpatched(model)


_PLACEHOLDERS = tuple(f"{kind}_token_{suffix}" for kind in ("image", "video", "audio") for suffix in ("id", "index"))


def _placeholders_in_vocab(model: Any, batch: dict[str, Any]) -> list[str]:
    """Move the config's image / video / audio placeholder ids that lie outside the tiny text vocabulary (Gemma 4's
    video and audio ids keep their checkpoint values) to unused ids at its top, as a checkpoint's are inside it:
    LLM's steps run the model on ``inputs_embeds``, where its placeholder masks embed those ids (generate() compares
    them with ``input_ids``). Returns the names moved."""
    config = model.config
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    ids = {k: v for k, v in config.to_dict().items()
           if k.endswith(("_token_id", "_token_index")) and isinstance(v, int) and not isinstance(v, bool)}
    used = set(ids.values()) | set(batch["input_ids"].flatten().tolist())
    free = (i for i in range(vocab - 1, 0, -1) if i not in used)
    moved = [k for k in _PLACEHOLDERS if ids.get(k, -1) >= vocab]
    for name in moved:
        setattr(config, name, next(free))
    return moved


def _compare_llm(outputs: list[Any], refs: list[tuple[list[int], list[Any]]]) -> sm.PathResult:
    """Each request's tokens against its reference (equal, or first differing at a reference tie) and the chosen
    and top tokens' logprobs within 1e-4 of the reference's log-softmax up to there."""
    worst, problems = 0.0, []
    for row, (out, (ref_tokens, ref_lps)) in enumerate(zip(outputs, refs, strict=True)):
        done = out.outputs[0]
        ok, steps, why = sm._compare_tokens(ref_tokens, list(done.token_ids), ref_lps)
        if not ok:
            problems.append(f"prompt {row}: {why}")
        if len(done.logprobs or []) < steps:
            problems.append(f"prompt {row}: {len(done.logprobs or [])} logprobs for {steps} tokens")
        for step, got in enumerate((done.logprobs or [])[:steps]):
            diffs = [abs(got.logprob - float(ref_lps[step][done.token_ids[step]]))]
            diffs += [abs(lp - float(ref_lps[step][tok])) for tok, lp in got.top.items()]
            worst = max(worst, *diffs)
    if worst > sm.LOGIT_ATOL:
        problems.append(f"max |logprob diff| {worst:.3g}")
    return sm.PathResult("silent" if problems else "exact", "; ".join(problems), worst)


def _engine_refusal(exc: ValueError) -> bool:
    """Whether a ValueError is flashpage's own (raised in flashpage's code: the engine refusing the request),
    not the model's (a forward that fails inside transformers is a crash)."""
    import traceback

    import flashpage

    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(Path(flashpage.__file__).parent)


def check_llm(model: Any, batch: dict[str, Any]) -> tuple[sm.PathResult, str]:
    """``flashpage.LLM`` with the batch's prompts as image requests (pre-processed: ``prompt_token_ids`` and the
    image tensors), each against unpatched generate() of that prompt alone. Returns (result, note): the budget is
    16 tokens, else (where LLM refuses a prompt or a two-way span longer than that) 2048, which the note says."""
    from flashpage.patches import UnsupportedModelError

    moved = _placeholders_in_vocab(model, batch)
    note = f"placeholder ids moved inside the tiny vocabulary for LLM: {', '.join(moved)}" if moved else ""
    rows = [prompt_alone(batch, i) for i in range(batch["input_ids"].shape[0])]
    refs = [_alone(model, ids, tensors) for ids, tensors in rows]
    requests = [{"prompt_token_ids": ids, "multi_modal_data": {"image": tensors}} for ids, tensors in rows]
    max_len = max(len(ids) for ids, _ in rows) + MAX_NEW_TOKENS + 1
    for budget in (LLM_BUDGET, LLM_WIDE_BUDGET):
        try:
            return _compare_llm(_llm_outputs(model, requests, budget, max_len), refs), note
        except UnsupportedModelError as exc:
            return sm.PathResult("refused", str(exc)), note
        except ValueError as exc:
            if not _engine_refusal(exc):
                return sm._crash(exc), note
            if budget == LLM_BUDGET and "max_num_batched_tokens" in str(exc):
                note = "; ".join(filter(None, [note, f"LLM budget {LLM_WIDE_BUDGET} (refused under {LLM_BUDGET}: "
                                                          f"{sm._short(str(exc), 80)})"]))
                continue
            return sm.PathResult("refused", str(exc)), note
    raise AssertionError("unreachable")


def run_type(model_type: str) -> VlmResult:
    """Sweep one type in this process."""
    import torch
    from vlm_zoo import NotBuildable, sweep_image_case

    from flashpage.patches import UnsupportedModelError, patch, unpatch

    sm._quiet()
    torch.set_num_threads(1)
    start = time.perf_counter()

    def row(path: sm.PathResult, llm: sm.PathResult | None = None, **kw: Any) -> VlmResult:
        return VlmResult(model_type, path, llm, time.perf_counter() - start, **kw)

    try:
        case = sweep_image_case(model_type)
    except NotBuildable as exc:
        return row(_refused_anyway(exc.model) or sm.PathResult("unbuildable", str(exc)))
    except Exception as exc:  # transformers' own: the model does not build here
        return row(sm.PathResult("unbuildable", "model: " + sm._crash(exc).detail))
    try:
        ref = _generate(case.model, case.inputs)
        effect = _effect(ref, _generate(case.model, case.other))
    except Exception as exc:  # the unpatched model does not run this prompt
        return row(sm.PathResult("unbuildable", "unpatched generate(): " + sm._crash(exc).detail), how=case.how)
    notes = [] if effect else ["image has no effect"]
    try:
        patch(case.model)
    except UnsupportedModelError as exc:
        return row(sm.PathResult("refused", str(exc)), how=case.how, effect=effect, notes=notes)
    except Exception as exc:
        return row(sm._crash(exc), how=case.how, effect=effect, notes=notes)
    try:
        result = _compare(ref, _generate(case.model, case.inputs))
    except UnsupportedModelError as exc:
        result = sm.PathResult("refused", str(exc))
    except Exception as exc:
        result = sm._crash(exc)
    finally:
        with contextlib.suppress(Exception):
            unpatch(case.model)
    llm = _llm_row(case.model, case.inputs, notes) if result.outcome == "exact" else NOT_RUN
    return row(result, llm, how=case.how, effect=effect, notes=notes)


def _llm_row(model: Any, batch: dict[str, Any], notes: list[str]) -> sm.PathResult:
    """:func:`check_llm` on the case's prompts, any other exception a crash; its note (if any) added to ``notes``;
    the model left unpatched."""
    try:
        result, note = check_llm(model, batch)
    except Exception as exc:
        result, note = sm._crash(exc), ""
    finally:
        with contextlib.suppress(Exception):
            sm._ensure_unpatched(model)
    if note:
        notes.append(note)
    return result


# ----------------------------------------------------------------------------------- workers
def _start_worker() -> sm._Worker:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=str(HERE.parent))
    os.set_blocking(proc.stdout.fileno(), False)
    return sm._Worker(proc)


@contextlib.contextmanager
def _image_runner() -> Iterator[None]:
    """The causal-LM sweep's runner, its workers running this script and its rows read as :class:`VlmResult`."""
    saved = sm._start_worker, sm.TypeResult
    sm._start_worker, sm.TypeResult = _start_worker, VlmResult
    try:
        yield
    finally:
        sm._start_worker, sm.TypeResult = saved


def run_sweep(types: Iterable[str], workers: int = 2, timeout: float = DEFAULT_TIMEOUT,
              progress: Any = None) -> list[VlmResult]:
    """Sweep ``types`` over ``workers`` processes, ``timeout`` seconds per type at most (input order kept)."""
    with _image_runner():
        return sm.run_sweep(types, workers, timeout, progress)


def all_types() -> list[str]:
    """The image-text-to-text mapping's types, then the multimodal-LM mapping's others, in their order."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    )

    return list(dict.fromkeys([*MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, *MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES]))


# ------------------------------------------------------------------------------------ docs
def summary(results: Sequence[VlmResult]) -> dict[str, int]:
    """Rows per generate() outcome."""
    counts = {k: 0 for k in sm.OUTCOMES}
    for r in results:
        counts[r.outcome] += 1
    return counts


def llm_summary(results: Sequence[VlmResult]) -> dict[str, int]:
    """Rows per LLM outcome (``not-run``: generate() not exact)."""
    counts = {k: 0 for k in LLM_OUTCOMES}
    for r in results:
        counts[r.llm.outcome] += 1
    return counts


def _why(r: VlmResult) -> str:
    """The row's last column: why generate() is not exact, else why LLM is not, else a note on the images."""
    if r.outcome != "exact":
        return sm._reason(r.image)
    if r.llm.outcome != "exact":
        return "LLM: " + sm._reason(r.llm)
    if r.effect is False:
        return "image has no effect on the tiny model (the images are not tested)"
    return ""


def readme_table(results: Sequence[VlmResult]) -> str:
    """docs/models.md's image matrix: a summary line and one row per type (nothing that varies between runs)."""
    import transformers

    counts, llm = summary(results), llm_summary(results)
    lines = [f"transformers {transformers.__version__}, {len(results)} image-text-to-text and multimodal-LM types, "
             f"patched `generate()` with image prompts: exact {counts['exact']}; refused {counts['refused']}; "
             f"not buildable here {counts['unbuildable']}; silent {counts['silent']}; crash {counts['crash']}. "
             f"`LLM` with the same image prompts, where `generate()` is exact: exact {llm['exact']}; "
             f"refused {llm['refused']}; silent {llm['silent']}; crash {llm['crash']}.", "",
             "| Type | `generate()` with images | `LLM` with images | Image prompt | Why not / note |",
             "|---|---|---|---|---|"]
    for r in results:
        llm_cell = "" if r.llm.outcome == "not-run" else r.llm.outcome
        lines.append(f"| {r.model_type} | {r.outcome} | {llm_cell} | {sm._short(r.how, 50)} | {_why(r)} |")
    return "\n".join(lines) + "\n"


def readme_section(text: str) -> str:
    return sm.marked_section(text, MATRIX_START, MATRIX_END)


def write_readme(results: Sequence[VlmResult], readme: Path = sm.README) -> None:
    sm.write_marked(readme, MATRIX_START, MATRIX_END, readme_table(results))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: both mappings)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per type")
    parser.add_argument("--json", type=Path, help="write the per-type results here")
    parser.add_argument("--readme", action="store_true", help="rewrite docs/models.md's image matrix")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        sm.run_type = run_type  # the causal-LM sweep's worker loop, sweeping this script's types
        sm.worker_main()
        return 0

    def show(r: VlmResult) -> None:
        note = r.image.detail or r.llm.detail or "; ".join(r.notes)
        print(f"{r.model_type:24s} {r.outcome:11s} {r.llm.outcome:8s} {r.seconds:5.1f}s {sm._short(r.how, 30):30s} "
              f"{sm._short(note, 130)}", flush=True)

    results = run_sweep(args.types or all_types(), args.workers, args.timeout, progress=show)
    print(json.dumps({"generate": summary(results), "llm": llm_summary(results)}))
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    if args.readme:
        write_readme(results)
    return 0 if all(r.outcome in sm.ALLOWED and r.llm.outcome in LLM_ALLOWED for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
