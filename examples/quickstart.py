# Mirrored by quickstart.ipynb: edit this script, then run `python examples/_build_notebooks.py`.
# ruff: noqa: E402

# %% [markdown]
# # flashpage quickstart: `generate()` on a paged KV cache
#
# `flashpage.patch(model)` routes a HuggingFace causal LM's attention through flashpage's paged KV
# cache (flash-attn's `(num_blocks, block_size, kv_heads, head_dim)` page layout) and makes the
# ordinary `model.generate()` use it. This notebook
#
# 1. generates greedily with the unpatched model (transformers' own dense `DynamicCache`),
# 2. patches the model and generates again: the token ids must be identical,
# 3. compares the paged cache's memory (`HFPagedCache.memory_stats()`) with the dense cache,
# 4. unpatches the model.
#
# It runs offline on CPU with flashpage's built-in tiny model (4M parameters, trained on Python's
# documentation, so expect readable word salad). To try a real model on a GPU, set `MODEL` to a
# hub id or a local path, `DEVICE = "cuda"` and `DTYPE = "bfloat16"` in the parameter cell.

# %% tags=["parameters"]
MODEL = None  # None = the built-in tiny model (offline); or a hub id / local path, e.g. on a GPU machine
DEVICE = "cpu"  # "cuda" on a GPU machine
DTYPE = "float32"  # "bfloat16" or "float16" on a GPU
MAX_NEW_TOKENS = 40

# %%
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashpage

if MODEL is None:
    model, tokenizer = flashpage.load_tiny_model(dtype=DTYPE, device=DEVICE)
else:
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {DEVICE}")

# %% [markdown]
# ## 1. Plain transformers
#
# A left-padded batch whose prompts have very different lengths: a dense cache stores every row
# at the padded width, padding included.

# %%
PROMPTS = [
    "The list",
    "Return the number of",
    "If the file",
    "This module provides functions for reading and writing files. The open() function returns a file "
    "object whose methods read and write the data; the file is closed when the object is deleted or when "
    "the close() method is called. If the file cannot be opened, an exception is raised. The mode argument "
    "is a string that says how the file is opened: 'r' for reading, 'w' for writing, and 'a' for appending. "
    "The default mode is 'r'. The optional buffering argument",
]


def cache_of(output):
    """The cache returned by generate(return_dict_in_generate=True) (`.cache` in newer transformers)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


tokenizer.padding_side = "left"
batch = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(DEVICE)
width = batch["input_ids"].shape[1]
settings = dict(
    max_new_tokens=MAX_NEW_TOKENS,
    do_sample=False,
    pad_token_id=tokenizer.pad_token_id,
    return_dict_in_generate=True,
    output_logits=True,
)
with torch.inference_mode():
    reference = model.generate(**batch, **settings)
dense_cache = cache_of(reference)
print("prompt lengths:", batch["attention_mask"].sum(dim=1).tolist(), "-> padded width", width)
print("dense cache:", type(dense_cache).__name__)

# %% [markdown]
# ## 2. Patched: the same `generate()` call on the paged cache
#
# With `return_dict_in_generate=True` the returned cache is flashpage's `HFPagedCache`. In float32
# the paged path is token-identical; in bfloat16/float16 two kernels may round a near-tie
# differently, so there the check accepts a first difference only where the reference's top two
# logits tie (`flashpage.testing.compare_greedy`).

# %%
flashpage.patch(model)
assert flashpage.is_patched(model)
with torch.inference_mode():
    paged = model.generate(**batch, **settings)
paged_cache = cache_of(paged)
assert isinstance(paged_cache, flashpage.HFPagedCache), type(paged_cache)

ref_new = reference.sequences[:, width:]
got_new = paged.sequences[:, width:]
if DTYPE == "float32":
    assert torch.equal(ref_new, got_new), "patched generate() changed the greedy tokens"
else:
    from flashpage.testing import compare_greedy

    for row in range(len(PROMPTS)):
        logits = [step[row] for step in reference.logits]
        match = compare_greedy(ref_new[row].tolist(), got_new[row].tolist(), logits)
        assert match.ok, f"row {row}: {match.explain()}"
print("identical token ids:", torch.equal(ref_new, got_new))
for prompt, row in zip(PROMPTS, got_new, strict=True):
    shown = prompt if len(prompt) <= 60 else prompt[:60] + "..."
    print(f"{shown!r} -> {tokenizer.decode(row, skip_special_tokens=True)!r}")

# %% [markdown]
# ## 3. Memory: paged blocks vs the dense cache
#
# The paged cache stores only real tokens (no left padding), rounded up to whole blocks. The
# dense `DynamicCache` holds `batch x padded length` for every layer. (The page pool is sized at
# the first forward from the batch's real lengths and grows if a generation outlives it.)

# %%
stats = paged_cache.memory_stats()
dense_bytes = sum(
    t.nbytes
    for layer in dense_cache.layers
    for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
    if isinstance(t, torch.Tensor)
)
new_len = paged.sequences.shape[1] - width
real_tokens = int(batch["attention_mask"].sum()) + len(PROMPTS) * (new_len - 1)  # last token is never fed back
kib = 1024
rows = [
    ("dense DynamicCache (padded)", len(PROMPTS) * (width + new_len - 1), dense_bytes),
    ("paged: blocks in use", stats.token_slots_in_use, stats.bytes_in_use),
    ("paged: pool allocated", stats.num_blocks * stats.block_size, stats.bytes_allocated),
]
print(f"{'':32}{'token slots':>12}{'KiB':>10}")
for name, slots, nbytes in rows:
    print(f"{name:32}{slots:>12}{nbytes / kib:>10.1f}")
print(
    f"real tokens stored: {stats.tokens_stored} in {stats.blocks_in_use} blocks of {stats.block_size}; "
    f"dense / paged in use = {stats.saving:.2f}x"
)

# only real tokens are stored, in as few whole blocks as their lengths allow
assert stats.tokens_stored == real_tokens, (stats.tokens_stored, real_tokens)
assert stats.tokens_stored <= stats.token_slots_in_use
if MODEL is None:  # the tiny model (full attention in every layer), one long prompt and three short ones
    assert stats.dense_bytes == dense_bytes, "memory_stats() estimates the dense cache exactly"
    assert stats.bytes_in_use < dense_bytes

# %% [markdown]
# ## 4. Unpatch
#
# `flashpage.unpatch(model)` restores exactly the previous attention and `generate()`
# (`with flashpage.patched(model): ...` scopes a patch instead).

# %%
flashpage.unpatch(model)
assert not flashpage.is_patched(model)
with torch.inference_mode():
    again = model.generate(**batch, **settings)
assert torch.equal(again.sequences, reference.sequences)
assert not isinstance(cache_of(again), flashpage.HFPagedCache)
print("unpatched: back to", type(cache_of(again)).__name__)
