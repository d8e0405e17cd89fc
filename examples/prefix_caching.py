# Mirrored by prefix_caching.ipynb: edit this script, then run `python examples/_build_notebooks.py`.
# ruff: noqa: E402

# %% [markdown]
# # Prefix caching: requests that share a long system prompt
#
# With `enable_prefix_caching=True` (the default), every full KV block is identified by a chained
# hash of its tokens and of all tokens before it (the tokens are compared too, so a collision can
# never serve wrong K/V). A request whose prompt starts with blocks already in the pool reuses
# them, reference-counted, instead of computing them again. This notebook
#
# 1. runs the same requests, all starting with one long system prompt, with prefix caching on and off,
# 2. compares the prefix hit rate, the prompt tokens computed and the time, and checks the outputs agree,
# 3. draws which KV blocks each request uses, read from the block tables while the requests run.
#
# Offline on CPU with the built-in tiny model by default; set `MODEL`, `DEVICE = "cuda"` and
# `DTYPE = "bfloat16"` for a real model on a GPU.

# %% tags=["parameters"]
MODEL = None  # None = the built-in tiny model (offline); or a hub id / local path, e.g. on a GPU machine
DEVICE = "cpu"  # "cuda" on a GPU machine
DTYPE = "float32"  # "bfloat16" or "float16" on a GPU
NUM_REQUESTS = 8
MAX_TOKENS = 24
BLOCK_SIZE = None  # tokens per KV block; None = flashpage's default for the device (16; 256 with flash-attn 2)
KV_CACHE_MEMORY = 64 * 2**20  # bytes (not GiB) of KV pages; None = default (CPU: sized from the model; GPU: free)
OUTPUT_DIR = None  # where the picture goes; None = a new temporary folder

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
block_size = BLOCK_SIZE or flashpage.default_block_size(DEVICE)
output_dir = Path(OUTPUT_DIR) if OUTPUT_DIR else Path(tempfile.mkdtemp(prefix="flashpage-examples-"))
output_dir.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## The requests
#
# One system prompt, then a short question per request. Only *full* blocks are shared, so the
# system prompt is repeated until it spans several blocks whatever the block size.

# %%
SYSTEM = (
    "You answer questions about the Python standard library. Answer briefly and precisely. When a "
    "function takes optional arguments, name their default values. When a function can raise an "
    "exception, say which exception and when. If the question is about a module, describe what the "
    "module provides and name its most useful functions and classes. Do not invent functions that do "
    "not exist. Use the terms of the documentation: a list is a mutable sequence, a tuple is an "
    "immutable sequence, a dictionary maps keys to values, and a file object is returned by open().\n\n"
)
QUESTIONS = [
    "What does the sort method of a list return?",
    "How do I read a file line by line?",
    "What does the os module provide?",
    "When is KeyError raised?",
    "What is the default value of the sep argument of print?",
    "How do I join a list of strings?",
    "What does the json module do?",
    "What is a tuple?",
    "How do I copy a dictionary?",
    "What does the range function return?",
]
system = SYSTEM
while len(tokenizer(system)["input_ids"]) < 4 * block_size:
    system += SYSTEM
prompts = [f"{system}Question: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:" for i in range(NUM_REQUESTS)]
system_tokens = len(tokenizer(system)["input_ids"])
prompt_tokens = [len(tokenizer(p)["input_ids"]) for p in prompts]
print(f"system prompt: {system_tokens} tokens = {system_tokens / block_size:.1f} blocks of {block_size}")
print("prompt lengths:", prompt_tokens)

# %% [markdown]
# ## Running with and without prefix caching
#
# The loop drives the engine by hand (`add_request` / `step`) so it can read the block tables
# while the requests run: `llm.scheduler.running` lists the running sequences, and
# `llm.kv.blocks.block_table(seq.seq_id)` gives the physical block ids of one of them, in order.
# The snapshot kept is the step with the most requests running at once (all of them, here).
# The token budget per step is large enough for every prompt, so all are admitted in the first
# step; a request admitted after another one in that same step already finds its prompt blocks.

# %%
params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def serve(enable_prefix_caching):
    llm = LLM(
        model,
        tokenizer,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        kv_cache_memory=KV_CACHE_MEMORY,
        max_num_batched_tokens=max(2048, sum(prompt_tokens)),
    )
    llm.generate(["Warm up"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    before = llm.stats()
    ids = [llm.add_request(p, params, request_id=f"request {i}") for i, p in enumerate(prompts)]
    outputs, tables = {}, {}
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out
        running = {seq.group.request_id: llm.kv.blocks.block_table(seq.seq_id) for seq in llm.scheduler.running}
        if len(running) > len(tables):
            tables = running
    seconds = time.perf_counter() - start
    after = llm.stats()
    done = [outputs[i] for i in ids]
    cached = sum(o.metrics.cached_prompt_tokens for o in done)
    return {
        "outputs": done,
        "tables": {i: tables[i] for i in ids if i in tables},
        "seconds": seconds,
        "hit_rate": cached / sum(len(o.prompt_token_ids) for o in done),  # prompt tokens served from the cache
        "tokens_computed": after.tokens_computed - before.tokens_computed,
    }


runs = {on: serve(on) for on in (True, False)}

print(f"{'prefix caching':>16}{'hit rate':>10}{'tokens computed':>18}{'seconds':>10}")
for on, run in runs.items():
    print(f"{'on' if on else 'off':>16}{run['hit_rate']:>10.2f}{run['tokens_computed']:>18}{run['seconds']:>10.2f}")
with_cache, without = runs[True], runs[False]
saved = without["tokens_computed"] - with_cache["tokens_computed"]
print(
    f"prefix caching skipped {saved} prompt tokens of compute "
    f"({saved / without['tokens_computed']:.0%}) and {without['seconds'] - with_cache['seconds']:.2f} s"
)
print("cached prompt tokens per request:", [o.metrics.cached_prompt_tokens for o in with_cache["outputs"]])

assert with_cache["hit_rate"] > 0 and without["hit_rate"] == 0
assert with_cache["tokens_computed"] < without["tokens_computed"]
assert all(o.metrics.cached_prompt_tokens >= block_size for o in with_cache["outputs"][1:])
same = [a.token_ids == b.token_ids for a, b in zip(with_cache["outputs"], without["outputs"], strict=True)]
print(f"outputs identical with and without prefix caching: {sum(same)}/{len(same)}")
if DTYPE == "float32":
    assert all(same)
print(repr(with_cache["outputs"][0].prompt[-60:]), "->", repr(with_cache["outputs"][0].text))

# %% [markdown]
# ## Which blocks each request uses
#
# One row per request, one column per logical block of its sequence; the number is the physical
# block id. Blocks held by more than one request at the same moment are shared: with prefix
# caching the whole system prompt is stored once; without it every request has its own copy.

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap


def sharing(tables):
    """(grid, shared ids): grid[r][c] is 0 empty, 1 a block of this request only, 2 a shared block."""
    owners = {}
    for table in tables.values():
        for block in set(table):
            owners[block] = owners.get(block, 0) + 1
    shared = {b for b, n in owners.items() if n > 1}
    width = max(len(t) for t in tables.values())
    grid = [[(2 if b in shared else 1) for b in t] + [0] * (width - len(t)) for t in tables.values()]
    return grid, shared


fig, axes = plt.subplots(2, 1, figsize=(11, 1.6 + 0.9 * NUM_REQUESTS), squeeze=False)
colors = ListedColormap(["#ffffff", "#f2b880", "#5b8fd6"])
shared_ids = {}
for ax, (on, run) in zip(axes[:, 0], runs.items(), strict=True):
    tables = run["tables"]
    grid, shared_ids[on] = sharing(tables)
    ax.imshow(grid, cmap=colors, vmin=0, vmax=2, aspect="auto")
    for r, table in enumerate(tables.values()):
        for c, block in enumerate(table):
            ax.text(c, r, str(block), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(tables)), list(tables))
    ax.set_xticks(range(len(grid[0])))
    ax.set_xlabel("logical block of the sequence")
    ax.set_title(
        f"prefix caching {'on' if on else 'off'}: {len(shared_ids[on])} shared blocks (blue), "
        f"private blocks orange; hit rate {run['hit_rate']:.2f}"
    )
fig.tight_layout()
plot_path = output_dir / "prefix_blocks.png"
fig.savefig(plot_path, dpi=80)  # modest: the notebook embeds it
plt.close(fig)
print("picture written to", plot_path)
print("shared blocks with prefix caching:", sorted(shared_ids[True]))

assert len(with_cache["tables"]) == NUM_REQUESTS, "all requests were running at the same time"
assert len(shared_ids[True]) >= system_tokens // block_size - 1, "the system prompt's full blocks are shared"
assert not shared_ids[False], "without prefix caching nothing is shared"
assert plot_path.is_file() and plot_path.stat().st_size > 0
try:  # inside Jupyter, show it too
    from IPython import get_ipython
    from IPython.display import Image, display

    if get_ipython() is not None:
        display(Image(filename=str(plot_path)))
except ImportError:
    pass
