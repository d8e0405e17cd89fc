"""Peak memory of flashpage on a model of a published width: Qwen3-0.6B's config (hidden 1024, 16 query / 8 KV
heads of 128, intermediate 3072, vocab 151936, tied embeddings) with 2 of its 28 layers: 187M parameters,
748 MB in float32.

Tiny test models hide whatever costs a multiple of the model: the fast path's norm probe deep-copied each norm
module, whose ``_flashpage_state`` holds the whole patched model, so every probe copied the model (``LLM`` on the
full 2.4 GB Qwen3-0.6B was OOM-killed). Each case runs in a child process of its own and reads its peak RSS
(``VmHWM``); the bound is

    peak <= the child's peak after its imports + the weights + the KV pool [+ the engine's packed weight copies
            - what paging out their originals released, the cpu_prepack=True case] + OVERHEAD (1 GiB)

The cpu_prepack=True case runs on the model saved and loaded back with ``from_pretrained`` (float32 in its own
dtype: the weights lie in a mapping of the safetensors file), so the engine pages out the packed GEMMs'
originals: at least the layers' linear weights must be released (a tied LM head's original, the embedding, is
released too; a lookup reads back only its tokens' rows).

and the greedy tokens must equal unpatched transformers' ``generate()`` (one prompt at a time, float32; the
reference's top-1 / top-2 logit margins are checked so the comparison is decisive). A parent-side watchdog
kills a child past :data:`KILL_AT` so a regression fails the test instead of the machine.

Run a case by hand: ``python tests/engine/test_memory_real_shape.py llm`` (prints the measurements as JSON).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

LAYERS = 2  # of Qwen3-0.6B's 28: full width, so every per-module copy of the model shows
QWEN3_06B = {  # Qwen/Qwen3-0.6B config.json, num_hidden_layers apart
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True, "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False,
}
PAD = 151643
BLOCK_SIZE, NUM_BLOCKS = 16, 64  # the engine's KV pool: 1024 tokens x 2 layers x K+V x 8 x 128 x 4 B = 16 MiB
PROMPT_LENGTHS = (9, 14)
MAX_NEW = 8
OVERHEAD = 1 << 30  # activations, allocator slack, the engine's tables: 1 GiB, the goal
KILL_AT = 6 << 30  # the watchdog: ~2x the largest bound (~3 GiB), well under what the machine has
MIN_MARGIN = 1e-3  # the reference's smallest top-1 - top-2 logit gap (float32 rounding is ~1e-5)
CASES = ("llm", "llm-prepack", "generate")
TIMEOUT_S = 900


# ------------------------------------------------------------------------------------------------ child
def _status_bytes(field: str) -> int:
    """This process's ``field`` (VmHWM, VmRSS) from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model(layers: int = LAYERS, dtype: Any = None) -> Any:
    """A random-weight Qwen3 at Qwen3-0.6B's widths, ``layers`` deep, with its (tied) embedding scaled 4x so
    greedy is decisive (random init gives near-uniform logits)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_06B, num_hidden_layers=layers)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)
    return model.eval()


def _weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers, each storage once (the tied embedding / LM head)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, PAD, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _reference(model: Any, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Unpatched greedy ``generate()``, one prompt at a time: the tokens and the smallest top-1 - top-2 margin."""
    import torch

    tokens, margin = [], float("inf")
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=PAD, return_dict_in_generate=True, output_logits=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            for step in out.logits:
                top = step[0].float().topk(2).values
                margin = min(margin, float(top[0] - top[1]))
    return tokens, margin


def _reload(folder: str) -> Any:
    """The model saved in ``folder``, loaded by ``from_pretrained`` in its own dtype (file-backed tensors)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()


def _run_llm(model: Any, prompts: list[list[int]], prepack: bool) -> tuple[list[list[int]], dict[str, int]]:
    """``flashpage.LLM`` on the model with a 64-block pool: its greedy tokens and what it holds (KV, copies,
    original weights released)."""
    from flashpage import LLM, SamplingParams

    llm = LLM(model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=2, max_model_len=256,
              max_num_batched_tokens=256, cpu_prepack=prepack)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), use_tqdm=False)
    held = {"kv": llm.kv.bytes_per_block() * llm.kv.num_blocks,
            "prepack": llm._prepack.nbytes() if llm._prepack is not None else 0,
            "released": llm._prepack.released() if llm._prepack is not None else 0}
    return [list(o.outputs[0].token_ids) for o in outs], held


def _run_generate(model: Any, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, int]]:
    """``flashpage.patch`` and one left-padded batched greedy ``generate()``: its tokens and its KV pool's bytes."""
    import torch

    import flashpage

    flashpage.patch(model)
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=PAD, return_dict_in_generate=True)
    kv = out.past_key_values.kv
    return out.sequences[:, width:].tolist(), {"kv": kv.bytes_per_block() * kv.num_blocks, "prepack": 0, "released": 0}


def measure(case: str) -> dict[str, Any]:
    """In a fresh process: build the model, take the reference, run ``case``; the peak RSS and its bound's parts."""
    import torch  # noqa: F401  (the imports are part of the baseline)
    import transformers  # noqa: F401

    import flashpage  # noqa: F401

    baseline = _status_bytes("VmHWM")
    model = _model()
    weights = _weight_bytes(model)
    prompts = _prompts()
    ref, margin = _reference(model, prompts)
    built = _status_bytes("VmHWM")  # transformers' own peak: building the model, the reference generate()
    if case == "generate":
        got, held = _run_generate(model, prompts)
    elif case == "llm-prepack":
        import gc

        with tempfile.TemporaryDirectory(prefix="flashpage-real-shape-") as folder:
            model.save_pretrained(folder)
            model = None  # the in-memory weights freed before the file's are mapped
            gc.collect()
            model = _reload(folder)  # the mapping outlives the file's name
        got, held = _run_llm(model, prompts, prepack=True)
    else:
        got, held = _run_llm(model, prompts, prepack=False)
    peak = _status_bytes("VmHWM")
    bound = baseline + weights + held["kv"] + held["prepack"] - held["released"] + OVERHEAD
    return {"case": case, "peak": peak, "bound": bound, "baseline": baseline, "built": built, "weights": weights,
            **held,
            "overhead": OVERHEAD, "ref": ref, "got": got, "margin": margin}


# ----------------------------------------------------------------------------------------------- parent
def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _watched(case: str) -> tuple[dict[str, Any] | None, str]:
    """Run ``measure(case)`` in a child, killed past KILL_AT or TIMEOUT_S: its result (None if none) and output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen([sys.executable, __file__, case], stdout=log, stderr=subprocess.STDOUT, env=env)
        start, killed = time.monotonic(), ""
        while child.poll() is None:
            rss = _rss(child.pid)
            if rss > KILL_AT or time.monotonic() - start > TIMEOUT_S:
                child.kill()
                killed = f"killed by the watchdog: RSS {rss / 2**30:.2f} GiB (limit {KILL_AT / 2**30:.0f} GiB), " \
                         f"{time.monotonic() - start:.0f} s\n"
            time.sleep(0.02)
        log.seek(0)
        text = killed + log.read()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    return (json.loads(lines[-1][len("RESULT "):]) if lines else None), text


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("case", CASES)
def test_peak_rss_at_a_real_width_is_weights_plus_pool(case: str) -> None:
    result, output = _watched(case)
    assert result is not None, f"{case}: the child gave no result\n{output[-4000:]}"
    parts = ", ".join(f"{k} {_gib(result[k])}" for k in ("baseline", "weights", "kv", "prepack", "released",
                                                               "overhead"))
    print(f"{case}: peak {_gib(result['peak'])} (before flashpage {_gib(result['built'])}), "
          f"bound {_gib(result['bound'])} ({parts})")
    assert result["peak"] <= result["bound"], f"{case}: peak RSS {_gib(result['peak'])} > {_gib(result['bound'])} " \
                                              f"= {parts}"
    assert result["margin"] > MIN_MARGIN, f"the reference's greedy is not decisive (margin {result['margin']})"
    assert result["got"] == result["ref"], f"{case}: tokens differ from transformers' greedy generate()"
    if case == "llm-prepack":  # the 2 layers' linear weights (all but the tied LM head) paged out, most of them
        layers = LAYERS * 4 * (QWEN3_06B["hidden_size"] * (2 * 16 * 128 + 2 * 8 * 128)
                               + 3 * QWEN3_06B["hidden_size"] * QWEN3_06B["intermediate_size"])
        assert result["released"] > 0.8 * layers, f"released {_gib(result['released'])} of {_gib(layers)}"


def test_llm_and_generate_deep_copy_no_patched_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cheap tripwire of the same bug on a tiny Qwen3: no deep copy reaches a PatchState (each would copy
    the model its ``root`` holds) while LLM is built and generates, or while a patched model generates. A probe
    swallows its exceptions, so the copies are recorded, not only refused."""
    import torch
    from model_zoo import tiny_model

    from flashpage import LLM, SamplingParams, patch, unpatch
    from flashpage.patches.patching import PatchState

    copied: list[str] = []

    def refuse(state: PatchState, memo: dict[int, Any]) -> PatchState:
        copied.append(type(state.root).__name__)
        raise RuntimeError("deep copy of a PatchState (and the model it holds)")

    monkeypatch.setattr(PatchState, "__deepcopy__", refuse, raising=False)
    model = tiny_model("qwen3", max_position_embeddings=512)
    try:
        llm = LLM(model, num_blocks=32, max_num_seqs=2)
        llm.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert not copied, f"LLM deep-copied the patched model's state: {copied}"
        assert llm.fastpath.norms > 0 and llm.fastpath.mlps > 0, llm.fastpath.describe()  # the probes ran
        unpatch(model)
        patch(model).generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    finally:
        unpatch(model)
    assert not copied, f"patched generate() deep-copied the model's state: {copied}"


if __name__ == "__main__":
    print("RESULT " + json.dumps(measure(sys.argv[1])), flush=True)
