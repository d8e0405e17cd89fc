"""Train flashpage's built-in tiny Llama model on CPU, reproducibly, from text that ships with Python.

Usage::

    python -m flashpage.tiny.train [--out DIR] [--steps N] [--seed S] [--threads T]

Steps:

1. corpus: :func:`flashpage.tiny.corpus.build_corpus` (pydoc help topics + stdlib docstrings read
   with :mod:`ast`, deterministic order, capped);
2. tokenizer: a byte-level BPE (``tokenizers``) with ``<|endoftext|>`` as bos/eos/pad, wrapped in
   :class:`transformers.PreTrainedTokenizerFast`;
3. data: documents joined with ``<|endoftext|>``, cut into blocks of ``--seq-len`` tokens; every
   50th block is held out for validation; the training blocks are visited in a seeded permutation
   per epoch;
4. model: a small GQA :class:`transformers.LlamaForCausalLM`, trained with AdamW (warmup + cosine
   decay, gradient clipping);
5. save: weights in float16 (``config.json`` keeps ``dtype: float32`` so ``from_pretrained`` upcasts
   by default), tokenizer, generation config and a model card ``README.md``; then the saved folder
   is reloaded and a few greedy samples are printed.

With the same seed, step count, thread count and library versions the run is bit-reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashpage.tiny import tiny_model_path
from flashpage.tiny.corpus import MAX_CORPUS_CHARS, build_corpus

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
SAMPLE_PROMPTS = ("The list", "Return the", "If the")


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run (all recorded in the model card)."""

    steps: int = 1200
    seed: int = 0
    threads: int = 2
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 8
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_corpus_chars: int = MAX_CORPUS_CHARS
    val_every: int = 50  # every n-th block is held out
    log_every: int = 25


# ----------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``docs``; ``<|endoftext|>`` (id 0) is bos, eos and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def pack_blocks(docs: Sequence[str], tokenizer: PreTrainedTokenizerFast, seq_len: int) -> torch.Tensor:
    """Token ids of ``<|endoftext|> doc0 <|endoftext|> doc1 ...`` cut into ``[n, seq_len]`` blocks."""
    eos = tokenizer.eos_token_id
    assert eos is not None
    stream: list[int] = []
    # the backend encodes without the "longer than model_max_length" warning
    for enc in tokenizer.backend_tokenizer.encode_batch(list(docs), add_special_tokens=False):
        stream.append(eos)
        stream.extend(enc.ids)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


# ---------------------------------------------------------------------------------------------- model


def make_config(vocab_size: int, eos_id: int) -> LlamaConfig:
    """The tiny Llama: hidden 256, 4 layers, 4 query heads / 2 KV heads (GQA), tied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``peak_lr``, then cosine decay to ``min_lr_ratio * peak_lr``."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.peak_lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over ``blocks``."""
    model.eval()
    losses = [
        float(model(input_ids=blocks[i : i + batch_size], labels=blocks[i : i + batch_size]).loss)
        for i in range(0, len(blocks), batch_size)
    ]
    model.train()
    return sum(losses) / max(1, len(losses))


@dataclass
class _TrainData:
    """Corpus, tokenizer and train/validation blocks of one run."""

    docs: list[str]
    n_chars: int
    tokenizer: PreTrainedTokenizerFast
    eos: int
    train_blocks: torch.Tensor
    val_blocks: torch.Tensor
    n_tokens: int


def _setup_torch(cfg: TrainConfig) -> None:
    """Set torch's thread count and seed, and make it deterministic."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)


def _prepare_data(cfg: TrainConfig) -> _TrainData:
    """Build the corpus, train the tokenizer and split the packed blocks into train / validation."""
    docs = build_corpus(cfg.max_corpus_chars)
    n_chars = sum(map(len, docs))
    print(f"corpus: {len(docs)} documents, {n_chars:,} characters", flush=True)
    tokenizer = train_tokenizer(docs, cfg.vocab_size)
    eos = tokenizer.eos_token_id
    assert eos is not None
    blocks = pack_blocks(docs, tokenizer, cfg.seq_len)
    is_val = torch.arange(len(blocks)) % cfg.val_every == cfg.val_every - 1
    train_blocks, val_blocks = blocks[~is_val], blocks[is_val]
    n_tokens = blocks.numel()
    print(
        f"tokenizer: vocab {len(tokenizer)}; {n_tokens:,} tokens "
        f"({n_chars / n_tokens:.2f} chars/token); {len(train_blocks)} train / {len(val_blocks)} val "
        f"blocks of {cfg.seq_len}",
        flush=True,
    )
    return _TrainData(docs, n_chars, tokenizer, eos, train_blocks, val_blocks, n_tokens)


def _build_model(vocab_size: int, eos: int) -> tuple[LlamaForCausalLM, int]:
    """A freshly initialised tiny Llama in training mode, and its parameter count."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(make_config(vocab_size, eos))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    return model, n_params


def _make_optimizer(model: LlamaForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _train_steps(
    model: LlamaForCausalLM, opt: torch.optim.Optimizer, train_blocks: torch.Tensor, cfg: TrainConfig
) -> tuple[list[float], float]:
    """Run ``cfg.steps`` optimizer steps; returns the last ``log_every`` losses and the seconds taken."""
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(train_blocks), generator=gen)
    cursor = 0
    epoch = 0
    recent: list[float] = []
    t_train = time.perf_counter()
    for step in range(cfg.steps):
        if cursor + cfg.batch_size > len(order):
            order = torch.randperm(len(train_blocks), generator=gen)
            cursor = 0
            epoch += 1
        batch = train_blocks[order[cursor : cursor + cfg.batch_size]]
        cursor += cfg.batch_size
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-cfg.log_every :]
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            elapsed = time.perf_counter() - t_train
            print(
                f"step {step + 1:5d}/{cfg.steps}  loss {sum(recent) / len(recent):.4f}  lr {lr:.2e}  "
                f"epoch {epoch}  {elapsed:6.1f}s",
                flush=True,
            )
    return recent, time.perf_counter() - t_train


def _save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, eos: int, out: Path) -> None:
    """Save float16 weights, a float32 config, the generation config and the tokenizer to ``out``."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        do_sample=False,
        max_new_tokens=64,
    )
    model.half().save_pretrained(out)
    # Weights are stored as float16 to halve the file; config.json still says float32 so that
    # from_pretrained(dtype="auto") (the default) upcasts, which is what CPU users want.
    model.config.dtype = torch.float32
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():  # safetensors writes 0600; package data should be world-readable
        if path.is_file():
            path.chmod(0o644)


def _print_samples(samples: dict[str, str]) -> None:
    """Print each greedy sample under its prompt."""
    for prompt, text in samples.items():
        print(f"--- {prompt!r}\n{text}\n")


def train(cfg: TrainConfig, out: Path, command: str) -> dict[str, object]:
    """Run the whole pipeline and save the model to ``out``; returns the recorded results."""
    t0 = time.perf_counter()
    _setup_torch(cfg)
    data = _prepare_data(cfg)
    model, n_params = _build_model(len(data.tokenizer), data.eos)
    opt = _make_optimizer(model, cfg)
    recent, train_seconds = _train_steps(model, opt, data.train_blocks, cfg)
    final_loss = sum(recent) / len(recent)
    val_loss = evaluate(model, data.val_blocks, cfg.batch_size)
    print(f"final train loss {final_loss:.4f} (mean of last {len(recent)} steps); val loss {val_loss:.4f}")

    _save_model(model, data.tokenizer, data.eos, out)
    samples = greedy_samples(out, SAMPLE_PROMPTS, max_new_tokens=40)
    _print_samples(samples)
    results: dict[str, object] = {
        "command": command,
        "config": asdict(cfg),
        "documents": len(data.docs),
        "characters": data.n_chars,
        "tokens": data.n_tokens,
        "epochs_seen": round(cfg.steps * cfg.batch_size / len(data.train_blocks), 2),
        "parameters": n_params,
        "final_train_loss": round(final_loss, 4),
        "val_loss": round(val_loss, 4),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "safetensors_bytes": (out / "model.safetensors").stat().st_size,
        "samples": samples,
        "versions": _versions(),
    }
    (out / "README.md").write_text(model_card(results), encoding="utf-8")
    print(json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=2))
    return results


def _versions() -> dict[str, str]:
    """Versions of Python and the libraries that determine the trained bits."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
    }


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def greedy_samples(folder: Path, prompts: Sequence[str], max_new_tokens: int = 40) -> dict[str, str]:
    """Reload the saved model from ``folder`` in float32 and decode greedily from each prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    samples: dict[str, str] = {}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        samples[prompt] = tokenizer.decode(out[0], skip_special_tokens=True)
    return samples


def model_card(r: dict[str, object]) -> str:
    """The model card (``README.md``) written next to the weights."""
    cfg = r["config"]
    assert isinstance(cfg, dict)
    samples = r["samples"]
    assert isinstance(samples, dict)
    versions = r["versions"]
    assert isinstance(versions, dict)
    size = int(str(r["safetensors_bytes"]))
    sample_md = "\n\n".join(f"Prompt `{p}`:\n\n```text\n{t}\n```" for p, t in samples.items())
    return f"""# flashpage tiny model

A tiny Llama-architecture causal LM that ships inside flashpage (`flashpage/tiny/model/`) so the
CLI, the example notebooks and the tests have a real model that runs offline in a second on a CPU.
It is **not** a useful language model: it writes word-salad-ish but readable English/Python
documentation text (mostly real words, weak grammar, little meaning).

Load it with `flashpage.tiny.load_tiny_model()` or
`AutoModelForCausalLM.from_pretrained(flashpage.tiny.tiny_model_path())`.

## Architecture

`LlamaForCausalLM`: hidden 256, 4 layers, 4 attention heads of dim 64 with 2 KV heads (GQA),
MLP intermediate 688 (SiLU), RMSNorm eps 1e-5, default RoPE, max 1024 positions, tied input/output
embeddings, vocab {cfg["vocab_size"]}. {r["parameters"]:,} parameters. `model.safetensors` is
{size:,} bytes ({size / 2**20:.1f} MiB): weights are stored in float16; `config.json` says float32,
so the default `from_pretrained` upcasts (pass `dtype=` for float16/bfloat16).

Tokenizer: byte-level BPE trained with `tokenizers` on the same corpus (vocab {cfg["vocab_size"]},
min frequency 2); `<|endoftext|>` (id 0) is bos, eos and pad. No token is added automatically.
The generation config is greedy (`do_sample=False`), `max_new_tokens=64`, eos/pad = 0.

## Corpus

Only text that ships with CPython {versions["python"]}, read offline without importing anything:
`pydoc_data.topics.topics` (the help topics) followed by module/class/function docstrings of the
standard library (`ast.get_docstring` over the sorted `*.py` files of `sysconfig.get_paths()["stdlib"]`,
skipping test/, idlelib/, tkinter/, lib2to3/, site-packages/ and similar; docstrings under 40
characters and exact duplicates dropped), capped at {cfg["max_corpus_chars"]:,} characters. See
`flashpage/tiny/corpus.py`. This run: {r["documents"]:,} documents, {r["characters"]:,} characters,
{r["tokens"]:,} tokens.

## Training

Command (from the repository root):

```bash
{r["command"]}
```

Seed {cfg["seed"]}, {cfg["threads"]} CPU threads, torch {versions["torch"]}, transformers
{versions["transformers"]}, tokenizers {versions["tokenizers"]}; bit-reproducible for the same seed,
step count, thread count and versions. Documents are joined with `<|endoftext|>` and cut into
blocks of {cfg["seq_len"]} tokens; every {cfg["val_every"]}th block is held out. {cfg["steps"]} steps of
batch {cfg["batch_size"]} x {cfg["seq_len"]} tokens (about {r["epochs_seen"]} epochs) in a seeded
order, AdamW (betas 0.9/0.95, weight decay {cfg["weight_decay"]} on matrices), peak learning rate
{cfg["peak_lr"]} after {cfg["warmup_steps"]} warmup steps, cosine decay to {cfg["min_lr_ratio"]}x,
gradient clipping {cfg["grad_clip"]}.

- final training loss: **{r["final_train_loss"]}** (mean of the last {cfg["log_every"]} steps)
- held-out loss: **{r["val_loss"]}**
- training wall time: {r["train_seconds"]} s
  (whole run incl. corpus, tokenizer, saving: {r["total_seconds"]} s)

## Greedy samples (40 new tokens, float32)

{sample_md}
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of ``python -m flashpage.tiny.train``."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m flashpage.tiny.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=tiny_model_path(), help="output folder")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="random seed")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--lr", type=float, default=defaults.peak_lr, help="peak learning rate")
    args = parser.parse_args(argv)
    cfg = TrainConfig(
        steps=args.steps,
        seed=args.seed,
        threads=args.threads,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        peak_lr=args.lr,
        warmup_steps=min(defaults.warmup_steps, max(1, args.steps // 10)),
    )
    raw = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m flashpage.tiny.train", *raw])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    train(cfg, args.out, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
