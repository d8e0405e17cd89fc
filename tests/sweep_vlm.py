"""The image sweep: every type of the installed transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` and
``MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES``, patched ``generate()`` with image prompts against unpatched ``generate()``.

Per type (:func:`vlm_zoo.sweep_image_case`: float32, tiny random weights): a left-padded batch of two prompts with
one image each, greedy, a few new tokens, EOS off; tokens equal (or first differing at a reference tie) and every
step's logits within 1e-4. The same prompts with other images must change the unpatched logits (else the row says
the image has no effect: the comparison would prove nothing about images).

Outcomes (as tests/sweep_models.py): ``exact``; ``refused`` (flashpage's ``UnsupportedModelError`` from patch() or
generate(), before any output); ``unbuildable`` (no image prompt or no unpatched run here: the reason says why);
``silent`` (ran, differs: a bug); ``crash`` (another exception, a timeout, a dead worker: a bug). Types run in
worker processes with a per-type timeout (the causal-LM sweep's runner).

Command (writes the JSON and docs/models.md's image matrix)::

    python tests/sweep_vlm.py --workers 2 --json sweep_vlm.json --readme
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


@dataclass
class VlmResult:
    """One type's row: ``image`` is patched vs unpatched generate() with images; ``effect`` whether other images
    change the unpatched output (None: not measured)."""

    model_type: str
    image: sm.PathResult
    how: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    effect: bool | None = None

    def __init__(self, model_type: str, image: sm.PathResult, _unused: Any = None, seconds: float = 0.0,
                 notes: list[str] | None = None, how: str = "", effect: bool | None = None) -> None:
        # (model_type, path, path, seconds): the runner's own crash rows (sweep_models._failed) build it so
        self.model_type, self.image, self.seconds = model_type, image, seconds
        self.notes, self.how, self.effect = list(notes or []), how, effect

    @property
    def outcome(self) -> str:
        return self.image.outcome

    def to_json(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "image": asdict(self.image), "how": self.how,
                "effect": self.effect, "seconds": self.seconds, "notes": self.notes, "outcome": self.outcome}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VlmResult:
        return cls(data["model_type"], sm.PathResult(**data["image"]), None, data.get("seconds", 0.0),
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


def run_type(model_type: str) -> VlmResult:
    """Sweep one type in this process."""
    import torch
    from vlm_zoo import NotBuildable, sweep_image_case

    from flashpage.patches import UnsupportedModelError, patch, unpatch

    sm._quiet()
    torch.set_num_threads(1)
    start = time.perf_counter()

    def row(path: sm.PathResult, **kw: Any) -> VlmResult:
        return VlmResult(model_type, path, None, time.perf_counter() - start, **kw)

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
    return row(result, how=case.how, effect=effect, notes=notes)


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
    counts = {k: 0 for k in sm.OUTCOMES}
    for r in results:
        counts[r.outcome] += 1
    return counts


def readme_table(results: Sequence[VlmResult]) -> str:
    """docs/models.md's image matrix: a summary line and one row per type (nothing that varies between runs)."""
    import transformers

    counts = summary(results)
    lines = [f"transformers {transformers.__version__}, {len(results)} image-text-to-text and multimodal-LM types, "
             f"patched `generate()` with image prompts: exact {counts['exact']}; refused {counts['refused']}; "
             f"not buildable here {counts['unbuildable']}; silent {counts['silent']}; crash {counts['crash']}.", "",
             "| Type | With images | Image prompt | Why not / note |", "|---|---|---|---|"]
    for r in results:
        why = sm._reason(r.image) if r.outcome != "exact" else ""
        if r.outcome == "exact" and r.effect is False:
            why = "image has no effect on the tiny model (the images are not tested)"
        lines.append(f"| {r.model_type} | {r.outcome} | {sm._short(r.how, 50)} | {why} |")
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
        note = r.image.detail or "; ".join(r.notes)
        print(f"{r.model_type:26s} {r.outcome:11s} {r.seconds:5.1f}s {sm._short(r.how, 30):30s} {sm._short(note, 140)}",
              flush=True)

    results = run_sweep(args.types or all_types(), args.workers, args.timeout, progress=show)
    print(json.dumps(summary(results)))
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    if args.readme:
        write_readme(results)
    return 0 if all(r.outcome in sm.ALLOWED for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
