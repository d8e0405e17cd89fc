# Mirrored by continuous_batching.ipynb: edit this script, then run `python examples/_build_notebooks.py`.
# ruff: noqa: E402

# %% [markdown]
# # Continuous batching with `flashpage.LLM`
#
# `flashpage.LLM(model, tokenizer)` serves many requests at once on one HuggingFace model: every
# step is one packed forward of all running sequences' new tokens (prefill chunks and decodes
# together) over the paged KV pool. A request that finishes frees its blocks at once and a waiting
# one takes its place, so nobody waits for the longest request of a batch. This notebook
#
# 1. generates greedily for a batch of prompts, each with its own output length,
# 2. checks a few of them against transformers' `generate()` run one prompt at a time,
# 3. streams one request token by token,
# 4. samples with a seed (reproducible whatever else is in the batch),
# 5. reads the engine's statistics and plots throughput against transformers' padded batch.
#
# Offline on CPU with the built-in tiny model by default; set `MODEL`, `DEVICE = "cuda"`,
# `DTYPE = "bfloat16"` and `KV_CACHE_MEMORY = None` (use free GPU memory) for a real model on a GPU.

# %% tags=["parameters"]
MODEL = None  # None = the built-in tiny model (offline); or a hub id / local path, e.g. on a GPU machine
DEVICE = "cpu"  # "cuda" on a GPU machine
DTYPE = "float32"  # "bfloat16" or "float16" on a GPU
NUM_PROMPTS = 32
MAX_TOKENS = 48  # the longest output; each request asks for its own length up to this
MAX_IN_FLIGHT = 8  # sequences decoded together at most, by LLM and by transformers' padded batches alike
NUM_CHECKED = 3  # requests also run one by one with transformers and compared token for token
KV_CACHE_MEMORY = 64 * 2**20  # bytes (not GiB) of KV pages; None = default (CPU: sized from the model; GPU: free)
SEED = 1234
OUTPUT_DIR = None  # where the plot goes; None = a new temporary folder

# %%
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashpage
from flashpage import LLM, SamplingParams

if MODEL is None:
    model, tokenizer = flashpage.load_tiny_model(dtype=DTYPE, device=DEVICE)
else:
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
output_dir = Path(OUTPUT_DIR) if OUTPUT_DIR else Path(tempfile.mkdtemp(prefix="flashpage-examples-"))
output_dir.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## 1. Many requests, each with its own length
#
# `SamplingParams` has vLLM's names; `temperature=0` is greedy. One `SamplingParams` per prompt
# gives every request its own `max_tokens`.

# %%
STARTS = [
    "The list",
    "Return the number of",
    "If the file",
    "This module provides",
    "The default value is",
    "Raise an exception",
    "The dictionary",
    "A string is",
    "The following example",
    "When the function is called",
    "Each element of the sequence",
    "The optional argument",
]
prompts = [STARTS[i % len(STARTS)] + (" the" if i // len(STARTS) % 2 else "") for i in range(NUM_PROMPTS)]
params = [SamplingParams(max_tokens=1 + (7 + 13 * i) % MAX_TOKENS, temperature=0.0) for i in range(NUM_PROMPTS)]

llm = LLM(model, tokenizer, kv_cache_memory=KV_CACHE_MEMORY, max_num_seqs=MAX_IN_FLIGHT)
llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
start = time.perf_counter()
outputs = llm.generate(prompts, params, use_tqdm=False)
llm_seconds = time.perf_counter() - start
llm_tokens = sum(len(o.token_ids) for o in outputs)
for o in outputs[:4]:
    print(f"[{o.finish_reason:6}] {o.prompt!r} -> {o.text!r}")
print(f"... {len(outputs)} requests, {llm_tokens} new tokens in {llm_seconds:.2f} s")
assert len(outputs) == NUM_PROMPTS
assert all(o.finished and len(o.token_ids) <= p.max_tokens for o, p in zip(outputs, params, strict=True))

# %% [markdown]
# ## 2. Same tokens as transformers
#
# `LLM` patched the model; `flashpage.unpatch(model)` gives transformers back its own attention
# for the reference (the engine re-patches by itself on its next step). Each checked prompt runs
# alone, unpadded, with `max_new_tokens` equal to the request's `max_tokens`.

# %%
flashpage.unpatch(model)
hf_tokens = 0
hf_single_seconds = 0.0
for i in range(NUM_CHECKED):
    inputs = tokenizer(prompts[i], return_tensors="pt").to(DEVICE)
    start = time.perf_counter()
    with torch.inference_mode():
        ref = model.generate(
            **inputs, max_new_tokens=params[i].max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    hf_single_seconds += time.perf_counter() - start
    ref_ids = ref[0, inputs["input_ids"].shape[1] :].tolist()
    hf_tokens += len(ref_ids)
    assert outputs[i].token_ids == ref_ids, (i, outputs[i].token_ids, ref_ids)
    print(f"request {i}: {len(ref_ids)} tokens, identical to transformers generate()")

# %% [markdown]
# The usual way to batch with transformers: left-padded batches of `MAX_IN_FLIGHT` prompts (the
# same number of sequences in flight as the engine gets), each generated up to its longest
# request; each row is then cut to its own length (and EOS), the rest is wasted work. The
# engine instead refills a finished request's place at once.

# %%
tokenizer.padding_side = "left"
padded_rows = []
hf_batch_seconds = 0.0
for first in range(0, NUM_PROMPTS, MAX_IN_FLIGHT):
    chunk = slice(first, first + MAX_IN_FLIGHT)
    batch = tokenizer(prompts[chunk], return_tensors="pt", padding=True).to(DEVICE)
    width = batch["input_ids"].shape[1]
    with torch.inference_mode():
        if first == 0:  # warm-up
            model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        start = time.perf_counter()
        padded = model.generate(**batch, max_new_tokens=max(p.max_tokens for p in params[chunk]), do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
        hf_batch_seconds += time.perf_counter() - start
    padded_rows += padded[:, width:].tolist()
eos = model.generation_config.eos_token_id
eos = set(eos) if isinstance(eos, (list, tuple)) else {tokenizer.eos_token_id if eos is None else eos}


def cut(row, max_tokens):
    """A padded-batch row cut to the request's own length: up to max_tokens, EOS included."""
    row = row[:max_tokens]
    end = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
    return row[:end]


rows = [cut(r, p.max_tokens) for r, p in zip(padded_rows, params, strict=True)]
hf_batch_tokens = sum(len(r) for r in rows)
agree = sum(r == o.token_ids for r, o in zip(rows, outputs, strict=True))
print(f"padded batch: {hf_batch_tokens} useful tokens in {hf_batch_seconds:.2f} s; {agree}/{len(rows)} rows equal")

# %% [markdown]
# ## 3. Streaming
#
# `llm.stream(...)` yields each request's new tokens (ids and text delta) as they are produced;
# the pieces add up to exactly what `generate()` returns.

# %%
pieces = []
print(prompts[0], end="")
for delta in llm.stream(prompts[0], params[0]):
    print(delta.text, end="", flush=True)
    pieces.append(delta)
print()
assert [t for d in pieces for t in d.token_ids] == outputs[0].token_ids
assert "".join(d.text for d in pieces) == outputs[0].text
assert pieces[-1].finished and pieces[-1].finish_reason == outputs[0].finish_reason

# %% [markdown]
# ## 4. Sampling with a seed
#
# `temperature > 0` samples (with `top_k`, `top_p`, `min_p`, penalties...). A `seed` makes a
# request's samples reproducible whatever else is batched with it: here the same prompts in
# reverse order, and one of them alone.

# %%
sampling = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=SEED)
first = llm.generate(prompts[:4], sampling, use_tqdm=False)
reversed_order = llm.generate(prompts[:4][::-1], sampling, use_tqdm=False)
alone = llm.generate(prompts[2], sampling, use_tqdm=False)
for a, b in zip(first, reversed_order[::-1], strict=True):
    assert a.token_ids == b.token_ids
assert alone[0].token_ids == first[2].token_ids
other_seed = llm.generate(
    prompts[2], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=SEED + 1), use_tqdm=False
)
print("seed", SEED, "->", repr(first[2].text))
print("seed", SEED + 1, "->", repr(other_seed[0].text))

# %% [markdown]
# ## 5. Engine statistics and throughput
#
# `llm.stats()` is a snapshot of the pool and counters (all calls so far). The plot compares
# useful new tokens per second: transformers one prompt at a time, transformers' padded batch,
# and `flashpage.LLM`. On a CPU with a 4M-parameter model, Python overhead dominates and the
# numbers say little; on a GPU with a real model and many requests of uneven length,
# continuous batching is where the paged cache pays off.

# %%
stats = llm.stats()
for field in ("blocks_total", "blocks_used", "blocks_free", "blocks_cached", "block_size", "steps"):
    print(f"{field:>22}: {getattr(stats, field)}")
print(f"{'prefix_cache_hit_rate':>22}: {stats.prefix_cache_hit_rate:.2f}")
print(f"{'generated_tokens':>22}: {stats.generated_tokens} in {stats.busy_seconds:.2f} s busy")
assert stats.running == stats.waiting == 0 and stats.blocks_used == 0  # everything finished and freed
assert stats.generated_tokens >= llm_tokens

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

systems = {
    f"transformers\none by one ({NUM_CHECKED} req.)": hf_tokens / hf_single_seconds,
    f"transformers\npadded batches of {MAX_IN_FLIGHT}": hf_batch_tokens / hf_batch_seconds,
    f"flashpage.LLM\n({MAX_IN_FLIGHT} in flight)": llm_tokens / llm_seconds,
}
fig, ax = plt.subplots(figsize=(7, 4))
bars = ax.bar(list(systems), list(systems.values()), color=["#999999", "#6699cc", "#ee7733"])
ax.bar_label(bars, fmt="%.0f")
ax.set_ylabel("useful new tokens / s")
ax.set_title(f"Greedy generation, {'built-in tiny model' if MODEL is None else MODEL} on {DEVICE}")
fig.tight_layout()
plot_path = output_dir / "throughput.png"
fig.savefig(plot_path, dpi=80)  # modest: the notebook embeds it
plt.close(fig)
assert plot_path.is_file() and plot_path.stat().st_size > 0
print("plot written to", plot_path)
try:  # inside Jupyter, show it too
    from IPython import get_ipython
    from IPython.display import Image, display

    if get_ipython() is not None:
        display(Image(filename=str(plot_path)))
except ImportError:
    pass
