# Mirrored by kernel_level.ipynb: edit this script, then run `python examples/_build_notebooks.py`.
# ruff: noqa: E402

# %% [markdown]
# # Kernel level: a paged KV cache under your own attention loop
#
# flash-attn ships paged-KV kernels (`flash_attn_with_kvcache(block_table=...)`,
# `flash_attn_varlen_func(block_table=...)`) but no cache manager; its users asked *"how would
# one use paged KV cache without a cache manager to copy / update the pages?"*, and wanted the
# same kernels for paged prefill, decoding and multi-token steps such as speculative decoding.
#
# This notebook is that use case without any model: random q/k/v stand in for a model's
# projections, and a hand-written loop over layers calls the kernels directly.
# `flashpage.PagedKVCache` owns the pages of every layer, in flash-attn's layout
# `(num_blocks, block_size, kv_heads, head_dim)`, and the block accounting; each step's plan
# (block table, slot mapping, `cu_seqlens`, lengths) is built once and shared by all layers.
# Every output is checked against plain dense softmax attention computed with torch.
#
# 1. **paged prefill** of prompts of different lengths: `store_kv` + `flash_attn_varlen_func`;
# 2. **decode steps**: `flash_attn_with_kvcache`, which appends the new K/V into the pages itself;
# 3. **speculative decoding**: append `NUM_DRAFT` draft tokens per sequence, verify them in one
#    multi-token call, then roll the rejected ones back with `truncate` and decode on.
#
# The kernels run flash-attn where it is installed and eligible (CUDA, fp16/bf16; flash-attn 2
# needs `BLOCK_SIZE = 256`), and flashpage's exact PyTorch reference everywhere else.

# %% tags=["parameters"]
DEVICE = "cpu"  # "cuda" on a GPU machine
DTYPE = "float32"  # "float16" / "bfloat16" on a GPU (flash-attn takes only those)
BLOCK_SIZE = 16  # tokens per page; 256 for flash-attn 2
NUM_LAYERS = 2
NUM_HEADS = 8  # query heads
NUM_KV_HEADS = 2  # key/value heads (grouped-query attention)
HEAD_DIM = 64
PROMPT_LENS = [42, 5, 80]  # one sequence per entry
DECODE_STEPS = 4
NUM_DRAFT = 5  # draft tokens verified per speculative step
SEED = 0

# %%
import math

import torch

import flashpage
from flashpage import PagedKVCache, flash_attn_varlen_func, flash_attn_with_kvcache, store_kv

dtype = getattr(torch, DTYPE)
gen = torch.Generator().manual_seed(SEED)
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}.get(dtype, 2e-2)  # half precision: rounding of P before P.V
scale = 1.0 / math.sqrt(HEAD_DIM)

for entry, choice in flashpage.backend_info(device=DEVICE, dtype=dtype, block_size=BLOCK_SIZE).items():
    print(f"{entry:24} -> {choice.reason}")


def rand(*shape):
    """Random activations standing in for a model's q/k/v projections."""
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def dense_attention(q, k, v):
    """Plain softmax attention of one sequence, causal, aligned bottom-right (flash-attn's rule).

    q (Sq, H, D) are the last Sq positions of a sequence whose keys/values are k, v (Sk, Hk, D).
    Query row i sees keys j <= i + Sk - Sq. Computed in float64 as the ground truth.
    """
    sq, sk = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def check(name, got, expected):
    err = (got.double() - expected).abs().max().item()
    assert torch.allclose(got.double(), expected, atol=TOL, rtol=TOL), f"{name}: max |diff| {err:.3g}"
    return err


# %% [markdown]
# ## The cache manager and the pages
#
# `PagedKVCache` allocates one K and one V page tensor per layer and a `BlockManager` (pure Python)
# that decides which block holds which token: `slot = block_id * block_size + offset`. Alongside,
# this notebook keeps the same K/V densely (`dense_k`, `dense_v`), only to compute the reference.

# %%
seqs = [f"seq{i}" for i in range(len(PROMPT_LENS))]
longest = max(PROMPT_LENS) + DECODE_STEPS + 2 * NUM_DRAFT + 1
num_blocks = len(seqs) * math.ceil(longest / BLOCK_SIZE) + 4
kv = PagedKVCache(
    NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype, device=DEVICE
)
for s in seqs:
    kv.add_sequence(s)
print("layer 0 key pages:", tuple(kv.k_pages(0).shape), kv.k_pages(0).dtype)

empty = torch.zeros(0, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
dense_k = [{s: empty for s in seqs} for _ in range(NUM_LAYERS)]
dense_v = [{s: empty for s in seqs} for _ in range(NUM_LAYERS)]

# %% [markdown]
# ## 1. Paged prefill: `store_kv` + `flash_attn_varlen_func`
#
# `plan` allocates blocks for every sequence's new tokens and returns the plan. Per layer:
# scatter the new K/V into the pages at `plan.slot_mapping` (`store_kv`), then attend over the
# pages with the packed queries (`cu_seqlens_q`) and the sequences' block tables.

# %%
plan = kv.plan(seqs, PROMPT_LENS)
print("block table:\n", plan.block_table)
total = sum(PROMPT_LENS)
for layer in range(NUM_LAYERS):
    q, k, v = rand(total, NUM_HEADS, HEAD_DIM), rand(total, NUM_KV_HEADS, HEAD_DIM), rand(total, NUM_KV_HEADS, HEAD_DIM)
    store_kv(kv.k_pages(layer), kv.v_pages(layer), k, v, plan.slot_mapping.to(DEVICE))
    out = flash_attn_varlen_func(
        q,
        kv.k_pages(layer),
        kv.v_pages(layer),
        cu_seqlens_q=plan.cu_seqlens_q.to(DEVICE),
        cu_seqlens_k=plan.cu_seqlens_k.to(DEVICE),
        max_seqlen_q=plan.max_seqlen_q,
        max_seqlen_k=plan.max_seqlen_k,
        causal=True,
        block_table=plan.block_table.to(DEVICE),
    )
    bounds = plan.cu_seqlens_q.tolist()
    for i, s in enumerate(seqs):
        rows = slice(bounds[i], bounds[i + 1])
        dense_k[layer][s] = k[rows]
        dense_v[layer][s] = v[rows]
        err = check(f"prefill layer {layer} {s}", out[rows], dense_attention(q[rows], k[rows], v[rows]))
print(f"prefill of {PROMPT_LENS} tokens matches dense attention (last max |diff| {err:.1e})")

# the pages hold exactly the K/V written, wherever the blocks are
for s in seqs:
    k_back, _, lengths = kv.gather(0, [s])
    assert torch.equal(k_back[0, : lengths[0]], dense_k[0][s])


# %% [markdown]
# ## 2. Decode steps: `flash_attn_with_kvcache` appends and attends in one call
#
# Each step adds one token per sequence. The plan allocates its slot (a new block when the last
# one is full); the kernel writes `k`/`v` at row `cache_seqlens[b]` of sequence b's block table
# and attends over everything up to it. `cache_seqlens` counts the tokens *before* the append.


# %%
def paged_step(num_new):
    """One step adding num_new tokens to every sequence, all layers; checked against dense attention."""
    plan = kv.plan(seqs, [num_new] * len(seqs))
    assert plan.uniform_query  # same query length everywhere: the (B, Sq, H, D) entry point applies
    cache_seqlens = torch.tensor(plan.context_lens, dtype=torch.int32, device=DEVICE)
    block_table = plan.block_table.to(DEVICE)
    b = len(seqs)
    for layer in range(NUM_LAYERS):
        q = rand(b, num_new, NUM_HEADS, HEAD_DIM)
        k, v = rand(b, num_new, NUM_KV_HEADS, HEAD_DIM), rand(b, num_new, NUM_KV_HEADS, HEAD_DIM)
        out = flash_attn_with_kvcache(
            q,
            kv.k_pages(layer),
            kv.v_pages(layer),
            k=k,
            v=v,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=True,
        )
        for i, s in enumerate(seqs):
            dense_k[layer][s] = torch.cat([dense_k[layer][s], k[i]])
            dense_v[layer][s] = torch.cat([dense_v[layer][s], v[i]])
            check(f"{s} layer {layer}", out[i], dense_attention(q[i], dense_k[layer][s], dense_v[layer][s]))
    return plan


for _ in range(DECODE_STEPS):
    paged_step(1)
lengths = [kv.num_tokens(s) for s in seqs]
assert lengths == [n + DECODE_STEPS for n in PROMPT_LENS]
print(f"{DECODE_STEPS} decode steps match dense attention; lengths now {lengths}, blocks in use {kv.stats().in_use}")

# %% [markdown]
# ## 3. Speculative decoding: verify `NUM_DRAFT` tokens at once, then roll back
#
# A draft model proposes `NUM_DRAFT` tokens per sequence; the target model runs them in one
# multi-token step (causal, bottom-right aligned: draft token i sees the cache and drafts <= i),
# which appends their K/V. Each sequence then accepts a prefix of its drafts (made up here) and
# `truncate` drops the rest: the blocks that held only rejected tokens go back to the pool, and
# the next step overwrites the rejected slots.

# %%
in_use = {"before the drafts": kv.stats().in_use}
verify_plan = paged_step(NUM_DRAFT)
in_use["with the drafts"] = kv.stats().in_use
print(f"verified {NUM_DRAFT} drafts per sequence in one call (lengths {[kv.num_tokens(s) for s in seqs]})")

accepted = [(i * 2) % (NUM_DRAFT + 1) for i in range(len(seqs))]  # e.g. [0, 2, 4]: drafts kept per sequence
for s, context, keep in zip(seqs, verify_plan.context_lens, accepted, strict=True):
    kv.truncate(s, context + keep)
    for layer in range(NUM_LAYERS):
        dense_k[layer][s] = dense_k[layer][s][: context + keep]
        dense_v[layer][s] = dense_v[layer][s][: context + keep]
    assert kv.num_tokens(s) == context + keep
    assert len(kv.blocks.block_table(s)) == math.ceil((context + keep) / BLOCK_SIZE)
in_use["after the rollback"] = kv.stats().in_use
print("accepted drafts per sequence:", accepted, "-> lengths", [kv.num_tokens(s) for s in seqs])
print("blocks in use:", in_use)
assert in_use["after the rollback"] == sum(math.ceil(kv.num_tokens(s) / BLOCK_SIZE) for s in seqs)

# decoding continues from the accepted tokens: the rejected K/V is never read again
for _ in range(2):
    paged_step(1)
kv.blocks.check_invariants()
print("decode after rollback matches dense attention")

# %% [markdown]
# ## Cleaning up
#
# `free` returns a sequence's blocks to the pool (with prefix caching, full blocks whose tokens
# were given stay findable until a new block is needed).

# %%
for s in seqs:
    kv.free(s)
stats = kv.stats()
assert stats.in_use == 0 and stats.free + stats.cached == stats.num_blocks
print(stats)
