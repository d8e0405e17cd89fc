"""Models for the generate/engine benchmarks: a seeded random Llama sized for CPU, or any checkpoint.

The built-in bench model is a LlamaForCausalLM built from a LlamaConfig with random weights:
8 layers, hidden 512, 8 heads of 64 (GQA: 2 KV heads), MLP 1376, vocab 8192, 2048 positions,
untied embeddings, float32: 30.5M parameters (22.2M in the layers, 4.2M each in the embedding
and the LM head). ``--quick`` uses the same shape with 4 layers (19.5M). Nothing is downloaded.

Random init (std 0.02) makes a poor greedy benchmark: the embeddings are tiny next to what the
layers add, and the greedy continuation collapses onto a 2-token loop whatever the prompt
(measured: 2 distinct tokens in 48, for 4 of 4 prompts). The embedding and the LM head are
multiplied by ``LOGIT_SCALE`` (4): the tokens then steer the residual stream and the output
(5-12 distinct tokens in 48), and the logits spread (median top-2 gap 0.12 -> 0.15, smallest of
192 steps 0.0023), far above float32 noise between attention kernels (~1e-6) and the 1e-5 tie
tolerance of :func:`flashpage.testing.compare_greedy`, so greedy is decisive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

LOGIT_SCALE = 4.0


@dataclass(frozen=True)
class BenchModel:
    """A model to benchmark and what the report says about it."""

    model: Any
    name: str
    vocab_size: int
    eos_token_id: int | None
    parameters: int
    dtype: str

    def run_facts(self) -> dict[str, Any]:
        """What every bench report says about the model and the machine it ran on."""
        return {"model": self.name, "parameters": self.parameters, "dtype": self.dtype,
                "device": str(next(self.model.parameters()).device), "threads": torch.get_num_threads(),
                "load_average_1m": load_average()}


def bench_config(quick: bool = False):
    """The LlamaConfig of the CPU bench model (4 layers with ``quick``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=4 if quick else 8,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa",
    )


def bench_model(seed: int = 0, quick: bool = False) -> Any:
    """The random Llama bench model (float32, eval mode), seeded; see the module docstring."""
    return seeded_llama(bench_config(quick), seed)


def seeded_llama(config: Any, seed: int) -> Any:
    """A LlamaForCausalLM with seeded random weights, embeddings and LM head scaled by ``LOGIT_SCALE``
    (see the module docstring), float32, eval mode."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(LOGIT_SCALE)
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    return model.to(torch.float32).eval()


def load_bench_model(name: str | None, quick: bool = False, seed: int = 0) -> BenchModel:
    """The bench model (``name`` None) or ``from_pretrained(name)`` (path or hub id), float32, eval."""
    if name is None:
        model = bench_model(seed=seed, quick=quick)
        label = f"random Llama ({model.config.num_hidden_layers} layers, hidden 512, x{LOGIT_SCALE:g} emb/lm_head)"
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(name), dtype=torch.float32).eval()
        label = str(name)
    if model.config._attn_implementation not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")
    config = model.config.get_text_config(decoder=True)
    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return BenchModel(model=model, name=label, vocab_size=int(config.vocab_size),
                      eos_token_id=None if eos is None else int(eos),
                      parameters=sum(p.numel() for p in model.parameters()), dtype="float32")


def random_prompts(lengths: list[int], vocab_size: int, seed: int, low: int = 3) -> list[list[int]]:
    """Seeded random token ids (ids < ``low`` are left out: pad/bos/eos of the bench model)."""
    gen = torch.Generator().manual_seed(seed)
    high = max(vocab_size, low + 1)
    return [torch.randint(low, high, (n,), generator=gen).tolist() for n in lengths]


def load_average() -> float:
    """1-minute load average when the run ends (other work on the machine makes timings noisy)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return -1.0


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both (B, longest) int64, prompts right-aligned after pad_id."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask
