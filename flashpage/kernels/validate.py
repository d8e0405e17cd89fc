"""Input checks shared by every kernel backend (flash-attn 2/3 and the PyTorch reference).

flash-attn rejects some inputs with a RuntimeError; flashpage raises KernelInputError (a
RuntimeError and a ValueError) for the same inputs, with a message that says what was wrong,
what was expected and what to do. The reference path additionally accepts fp32/fp64 and any
page size; everything else flash-attn rejects, the reference rejects too. flashpage also checks
what flash-attn silently gets wrong: KV capacity (CapacityError) and block ids out of range.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from flashpage.errors import CapacityError, KernelInputError

FLASH_DTYPES = (torch.float16, torch.bfloat16)
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
MORE_BLOCKS = "give the sequence more blocks in block_table"


@dataclass(frozen=True)
class KvcacheSpec:
    """Sizes of one flash_attn_with_kvcache call, after validation."""

    batch: int
    seqlen_q: int
    heads: int
    kv_heads: int
    head_dim: int
    paged: bool
    page_size: int  # P when paged, else 0
    num_blocks: int  # NB when paged, else batch_size of the dense cache
    capacity: int  # M * P when paged, else S_cache: flash-attn's seqlen_k
    new_tokens: int  # Sn (0 without k/v)


@dataclass(frozen=True)
class VarlenSpec:
    """Sizes of one flash_attn_varlen_func call, after validation."""

    batch: int
    total_q: int
    heads: int
    kv_heads: int
    head_dim: int
    paged: bool
    page_size: int
    num_blocks: int
    capacity: int  # M * P when paged, else total_k


def _fail(fn: str, msg: str) -> KernelInputError:
    return KernelInputError(f"{fn}: {msg}")


def check_dtypes(fn: str, tensors: dict[str, torch.Tensor | None], allowed: tuple[torch.dtype, ...]) -> None:
    """All given tensors share q's dtype, which must be in `allowed`."""
    q_dtype = tensors["q"].dtype
    if q_dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        hint = "flash-attn only supports fp16 and bf16" if allowed == FLASH_DTYPES else f"supported: {names}"
        raise _fail(
            fn,
            f"q has dtype {q_dtype}, which is not supported ({hint}); cast q, k, v and the "
            f"caches to one of {names}",
        )
    for name, t in tensors.items():
        if t is not None and t.dtype != q_dtype:
            raise _fail(
                fn,
                f"{name} has dtype {t.dtype} but q has {q_dtype}; q, k_cache, v_cache, k and v "
                "must share one dtype: cast them to the same dtype",
            )


def check_last_dim_contiguous(fn: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """flash-attn needs stride(-1) == 1 (views of a bigger tensor are fine otherwise)."""
    for name, t in tensors.items():
        if t is not None and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise _fail(
                fn,
                f"{name} must have a contiguous last dimension (stride(-1) == 1), got strides "
                f"{tuple(t.stride())}; pass {name}.contiguous()",
            )


def check_index_tensor(
    fn: str, name: str, t: torch.Tensor, shape: tuple[int, ...] | None, contiguous: str = "all"
) -> None:
    """An int32 index tensor (block_table, cache_seqlens, cu_seqlens, ...) of the given shape."""
    if not isinstance(t, torch.Tensor):
        raise _fail(fn, f"{name} must be a torch.Tensor of dtype torch.int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise _fail(
            fn,
            f"{name} must have dtype torch.int32, got {t.dtype}; use {name}.to(torch.int32) "
            "(flash-attn reads it as int32)",
        )
    if shape is not None and tuple(t.shape) != shape:
        raise _fail(fn, f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if contiguous == "all" and not t.is_contiguous():
        raise _fail(fn, f"{name} must be contiguous; pass {name}.contiguous()")
    if contiguous == "last" and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise _fail(fn, f"{name} must have a contiguous last dimension; pass {name}.contiguous()")


def check_heads(fn: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """H % Hk == 0 and head dim <= 256, as flash-attn requires."""
    if kv_heads <= 0 or heads % kv_heads != 0:
        raise _fail(
            fn,
            f"number of heads in key/value ({kv_heads}) must divide number of heads in query "
            f"({heads}); use a KV head count that divides the query head count",
        )
    if head_dim > MAX_HEAD_DIM:
        raise _fail(
            fn,
            f"head dimension {head_dim} is larger than {MAX_HEAD_DIM}, the most flash-attn "
            "supports; use a model with head_dim <= 256",
        )


def check_shape(fn: str, name: str, t: torch.Tensor, shape: tuple[int, ...], meaning: str) -> None:
    """Exact shape check with a message naming the expected layout."""
    if tuple(t.shape) != shape:
        raise _fail(fn, f"{name} must have shape {meaning} = {shape}, got {tuple(t.shape)}")


def check_alibi(fn: str, alibi_slopes: torch.Tensor | None, batch: int, heads: int) -> None:
    """ALiBi slopes: fp32, (H,) or (B, H), contiguous last dim."""
    if alibi_slopes is None:
        return
    if alibi_slopes.dtype != torch.float32:
        raise _fail(
            fn,
            f"alibi_slopes must have dtype torch.float32, got {alibi_slopes.dtype}; use alibi_slopes.float()",
        )
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise _fail(
            fn,
            f"alibi_slopes must have shape (H,) = ({heads},) or (B, H) = ({batch}, {heads}), "
            f"got {tuple(alibi_slopes.shape)}",
        )
    check_last_dim_contiguous(fn, {"alibi_slopes": alibi_slopes})


def check_s_aux(fn: str, s_aux: torch.Tensor | None, heads: int) -> None:
    """Attention-sink logits: one per query head."""
    if s_aux is None:
        return
    if not isinstance(s_aux, torch.Tensor) or tuple(s_aux.shape) != (heads,):
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise _fail(fn, f"s_aux must be a tensor of shape (H,) = ({heads},), got {shape}")
    if not s_aux.is_floating_point():
        raise _fail(fn, f"s_aux must be a floating point tensor, got {s_aux.dtype}")


def check_window(fn: str, window_size: tuple[int, int]) -> tuple[int, int]:
    """window_size is a pair of ints; -1 (any negative) means unbounded."""
    try:
        left, right = (int(window_size[0]), int(window_size[1]))
    except (TypeError, ValueError, IndexError) as exc:
        raise _fail(fn, f"window_size must be a pair (left, right) of ints, got {window_size!r}") from exc
    return left, right


def check_rotary(
    fn: str,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    has_k: bool,
    q: torch.Tensor,
    capacity: int,
) -> int:
    """Rotary tables as flash-attn checks them; returns rotary_dim (0 without rotary)."""
    if rotary_cos is None:
        if rotary_sin is not None:
            raise _fail(fn, "rotary_sin was given without rotary_cos; pass both or neither")
        return 0
    if not has_k:
        raise _fail(
            fn,
            "if rotary cos/sin are provided, new key / value to be appended to KV cache must "
            "also be provided (pass k and v, or apply rotary to q yourself)",
        )
    if rotary_sin is None:
        raise _fail(fn, "rotary_cos was given without rotary_sin; pass both")
    if rotary_cos.dim() != 2:
        raise _fail(
            fn, f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2), got {tuple(rotary_cos.shape)}"
        )
    rotary_dim = rotary_cos.shape[1] * 2
    head_dim = q.shape[-1]
    if rotary_dim > head_dim:
        raise _fail(
            fn, f"rotary_dim ({rotary_dim} = 2 * rotary_cos.shape[1]) must be <= head dim ({head_dim})"
        )
    if rotary_dim % 16 != 0:
        raise _fail(
            fn,
            f"rotary_dim {rotary_dim} is not divisible by 16; flash-attn only supports rotary "
            "dimensions divisible by 16 (apply rotary to q/k yourself for other sizes)",
        )
    if rotary_cos.shape[0] < capacity:
        raise _fail(
            fn,
            f"cos/sin seqlen ({rotary_cos.shape[0]}) must be at least the seqlen of the KV cache "
            f"({capacity}); build rotary_cos/rotary_sin for at least {capacity} positions",
        )
    if tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
        raise _fail(
            fn,
            f"rotary_sin must have the shape of rotary_cos {tuple(rotary_cos.shape)}, got "
            f"{tuple(rotary_sin.shape)}",
        )
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t.dtype != q.dtype:
            raise _fail(fn, f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
        if not t.is_contiguous():
            raise _fail(fn, f"{name} must be contiguous; pass {name}.contiguous()")
    return rotary_dim


def _check_kvcache_tensors(
    fn: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
) -> None:
    """q, k_cache and v_cache are 4-d tensors; all given tensors share a dtype and a contiguous last dim."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise _fail(fn, f"{name} must be a 4-d tensor, got {shape}")
    check_dtypes(fn, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v}, REFERENCE_DTYPES)
    check_last_dim_contiguous(fn, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v})


def _check_paged_cache(
    fn: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor,
    batch: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[int, int, int]:
    """Paged caches and their block_table; returns (num_blocks, page_size, capacity)."""
    if cache_batch_idx is not None:
        raise _fail(
            fn,
            "paged KV cache does not support cache_batch_idx (the block_table already says "
            "where each sequence lives); drop cache_batch_idx",
        )
    if cache_leftpad is not None:
        raise _fail(
            fn,
            "paged KV cache does not support cache_leftpad; drop cache_leftpad and start each "
            "sequence at logical row 0 of its block_table",
        )
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise _fail(fn, "block_table must be a (B, max_blocks_per_seq) int32 tensor")
    check_index_tensor(fn, "block_table", block_table, (batch, block_table.shape[1]), contiguous="last")
    num_blocks, page = k_cache.shape[0], k_cache.shape[1]
    capacity = block_table.shape[1] * page
    check_shape(fn, "k_cache", k_cache, (num_blocks, page, kv_heads, head_dim), "(NB, P, Hk, D)")
    check_shape(fn, "v_cache", v_cache, (num_blocks, page, kv_heads, head_dim), "(NB, P, Hk, D)")
    return num_blocks, page, capacity


def _check_dense_cache(
    fn: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    batch: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[int, int, int]:
    """Dense caches, cache_batch_idx and cache_leftpad; returns (num_blocks, 0, capacity)."""
    num_blocks, page, capacity = k_cache.shape[0], 0, k_cache.shape[1]
    check_shape(
        fn, "k_cache", k_cache, (num_blocks, capacity, kv_heads, head_dim), "(B_cache, S_cache, Hk, D)"
    )
    check_shape(
        fn, "v_cache", v_cache, (num_blocks, capacity, kv_heads, head_dim), "(B_cache, S_cache, Hk, D)"
    )
    if cache_batch_idx is not None:
        check_index_tensor(fn, "cache_batch_idx", cache_batch_idx, (batch,))
    elif num_blocks < batch:
        raise _fail(
            fn,
            f"the dense k_cache holds {num_blocks} sequences but q has batch {batch}; pass "
            "cache_batch_idx or a bigger cache",
        )
    if cache_leftpad is not None:
        check_index_tensor(fn, "cache_leftpad", cache_leftpad, (batch,))
    return num_blocks, page, capacity


def _check_new_kv(
    fn: str,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor | int | None,
    seqlen_q: int,
    capacity: int,
    batch: int,
    kv_heads: int,
    head_dim: int,
) -> int:
    """The new keys/values to append, if any; returns their length Sn (0 without k/v)."""
    if k is None and v is None:
        return 0
    if k is None or v is None:
        raise _fail(fn, "k and v must be given together (new keys and values to append)")
    if cache_seqlens is None:
        raise _fail(fn, "if key is supplied, cache_seqlens must also be passed in (where to append)")
    if seqlen_q > capacity:
        raise _fail(
            fn,
            f"if key is supplied, q must have seqlen ({seqlen_q}) <= the seqlen of the KV "
            f"cache ({capacity})",
        )
    new_tokens = k.shape[1] if k.dim() == 4 else -1
    check_shape(fn, "k", k, (batch, new_tokens, kv_heads, head_dim), "(B, Sn, Hk, D)")
    check_shape(fn, "v", v, (batch, new_tokens, kv_heads, head_dim), "(B, Sn, Hk, D)")
    return new_tokens


def _check_cache_seqlens(
    fn: str,
    cache_seqlens: torch.Tensor | int | None,
    paged: bool,
    num_blocks: int,
    batch: int,
    device: torch.device,
) -> torch.Tensor | None:
    """cache_seqlens as a (B,) int32 tensor (a Python int expanded as flash-attn does) or None."""
    if isinstance(cache_seqlens, bool):
        raise _fail(fn, "cache_seqlens must be a (B,) int32 tensor")
    if isinstance(cache_seqlens, int):
        if paged:
            raise _fail(
                fn,
                "a Python int cache_seqlens with a block_table is broken in flash-attn (it is "
                "expanded to num_blocks entries); pass a (B,) int32 tensor: "
                "torch.full((B,), n, dtype=torch.int32, device=q.device)",
            )
        if num_blocks != batch:
            raise _fail(
                fn,
                f"a Python int cache_seqlens is expanded to k_cache.shape[0] = {num_blocks} "
                f"entries but the batch is {batch}; pass a (B,) int32 tensor",
            )
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if cache_seqlens is not None:
        check_index_tensor(fn, "cache_seqlens", cache_seqlens, (batch,))
    return cache_seqlens


def check_kvcache(
    q,
    k_cache,
    v_cache,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    alibi_slopes,
    s_aux,
) -> tuple[KvcacheSpec, torch.Tensor | None]:
    """Validate a flash_attn_with_kvcache call (every backend). Returns the sizes and cache_seqlens
    as a (B,) int32 tensor (a Python int is expanded the way flash-attn does it) or None."""
    fn = "flash_attn_with_kvcache"
    _check_kvcache_tensors(fn, q, k_cache, v_cache, k, v)
    batch, seqlen_q, heads, head_dim = q.shape
    if batch <= 0:
        raise _fail(fn, "batch size must be positive (q.shape[0] == 0)")
    kv_heads = k_cache.shape[2]
    check_heads(fn, heads, kv_heads, head_dim)
    paged = block_table is not None
    if paged:
        num_blocks, page, capacity = _check_paged_cache(
            fn, k_cache, v_cache, cache_batch_idx, cache_leftpad, block_table, batch, kv_heads, head_dim
        )
    else:
        num_blocks, page, capacity = _check_dense_cache(
            fn, k_cache, v_cache, cache_batch_idx, cache_leftpad, batch, kv_heads, head_dim
        )
    new_tokens = _check_new_kv(fn, k, v, cache_seqlens, seqlen_q, capacity, batch, kv_heads, head_dim)
    cache_seqlens = _check_cache_seqlens(fn, cache_seqlens, paged, num_blocks, batch, k_cache.device)
    rotary_dim = check_rotary(fn, rotary_cos, rotary_sin, k is not None, q, capacity)
    del rotary_dim
    check_alibi(fn, alibi_slopes, batch, heads)
    check_s_aux(fn, s_aux, heads)
    spec = KvcacheSpec(
        batch, seqlen_q, heads, kv_heads, head_dim, paged, page, num_blocks, capacity, new_tokens
    )
    return spec, cache_seqlens


def check_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    block_table,
    alibi_slopes,
    s_aux,
) -> VarlenSpec:
    """Validate a flash_attn_varlen_func call (every backend)."""
    fn = "flash_attn_varlen_func"
    if dropout_p != 0:
        raise _fail(fn, f"dropout_p must be 0 (flashpage is forward/inference only), got {dropout_p}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise _fail(fn, "q must be a packed (total_q, H, D) tensor")
    paged = block_table is not None
    kdim = 4 if paged else 3
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != kdim:
            layout = "paged caches (NB, P, Hk, D) with a block_table" if paged else "packed (total_k, Hk, D)"
            raise _fail(
                fn,
                f"{name} must be {layout}, got shape "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}",
            )
    check_dtypes(fn, {"q": q, "k": k, "v": v}, REFERENCE_DTYPES)
    check_last_dim_contiguous(fn, {"q": q, "k": k, "v": v})
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise _fail(fn, f"{name} must be a (B + 1,) int32 tensor")
        check_index_tensor(fn, name, t, None)
    batch = cu_seqlens_q.numel() - 1
    if batch <= 0:
        raise _fail(fn, "batch size must be positive (cu_seqlens_q needs at least 2 entries)")
    check_index_tensor(fn, "cu_seqlens_k", cu_seqlens_k, (batch + 1,))
    total_q, heads, head_dim = q.shape
    kv_heads = k.shape[-2]
    check_heads(fn, heads, kv_heads, head_dim)
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise _fail(fn, "block_table must be a (B, max_blocks_per_seq) int32 tensor")
        check_index_tensor(fn, "block_table", block_table, (batch, block_table.shape[1]), contiguous="last")
        num_blocks, page = k.shape[0], k.shape[1]
        capacity = block_table.shape[1] * page
        check_shape(fn, "k", k, (num_blocks, page, kv_heads, head_dim), "(NB, P, Hk, D)")
        check_shape(fn, "v", v, (num_blocks, page, kv_heads, head_dim), "(NB, P, Hk, D)")
    else:
        num_blocks, page, capacity = 0, 0, k.shape[0]
        check_shape(fn, "k", k, (capacity, kv_heads, head_dim), "(total_k, Hk, D)")
        check_shape(fn, "v", v, (capacity, kv_heads, head_dim), "(total_k, Hk, D)")
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise _fail(fn, f"{name} must be a non-negative Python int, got {val!r}")
    check_alibi(fn, alibi_slopes, batch, heads)
    check_s_aux(fn, s_aux, heads)
    return VarlenSpec(batch, total_q, heads, kv_heads, head_dim, paged, page, num_blocks, capacity)


def _host(t: torch.Tensor) -> list[int]:
    return t.tolist()


def check_kvcache_lengths(
    spec: KvcacheSpec,
    cache_seqlens: torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> None:
    """Capacity and index-range checks that need the values (one host read on CUDA)."""
    fn = "flash_attn_with_kvcache"
    if cache_seqlens is None:
        lengths = [spec.capacity] * spec.batch
    else:
        lengths = _host(cache_seqlens)
    for b, n in enumerate(lengths):
        if n < 0:
            raise _fail(fn, f"cache_seqlens[{b}] = {n} is negative; it counts tokens already in the cache")
        if n + spec.new_tokens > spec.capacity:
            if spec.paged:
                raise CapacityError(
                    f"{fn}: sequence {b} does not fit: cache_seqlens[{b}] = {n} plus {spec.new_tokens} new "
                    f"token(s) = {n + spec.new_tokens} > {spec.capacity} = block_table.shape[1] "
                    f"({spec.capacity // spec.page_size}) * block_size ({spec.page_size}); {MORE_BLOCKS}"
                )
            raise CapacityError(
                f"{fn}: sequence {b} does not fit: cache_seqlens[{b}] = {n} plus {spec.new_tokens} new "
                f"token(s) = {n + spec.new_tokens} > S_cache = {spec.capacity}; allocate a longer dense cache"
            )
    if spec.paged:
        check_block_ids(
            fn, block_table, [n + spec.new_tokens for n in lengths], spec.page_size, spec.num_blocks
        )
        return
    if cache_batch_idx is not None:
        for b, i in enumerate(_host(cache_batch_idx)):
            if not 0 <= i < spec.num_blocks:
                raise _fail(
                    fn,
                    f"cache_batch_idx[{b}] = {i} is outside [0, {spec.num_blocks}) (the dense "
                    "cache's batch size)",
                )
    if cache_leftpad is not None:
        for b, (pad, n) in enumerate(zip(_host(cache_leftpad), lengths, strict=True)):
            if not 0 <= pad <= n:
                raise _fail(fn, f"cache_leftpad[{b}] = {pad} must be in [0, cache_seqlens[{b}] = {n}]")


def check_block_ids(
    fn: str, block_table: torch.Tensor, key_lengths: list[int], page: int, num_blocks: int
) -> None:
    """Ids of the blocks that will be read must lie in [0, NB); padding after them may be anything.

    Every layer of a forward passes the same block table: a table already checked with the same
    lengths (same tensor object, unmodified since) is not scanned again."""
    if not key_lengths:
        return
    # inference tensors have no version counter: identity alone (they are only written in inference mode)
    version = -1 if block_table.is_inference() else block_table._version
    key = (version, tuple(key_lengths), page, num_blocks)
    last = getattr(_CHECKED, "last", None)
    if last is not None and last[0] is block_table and last[1] == key:
        return
    _scan_block_ids(fn, block_table, key_lengths, page, num_blocks)
    _CHECKED.last = (block_table, key)


_CHECKED = threading.local()  # the last block table that passed check_block_ids, per thread


def _scan_block_ids(
    fn: str, block_table: torch.Tensor, key_lengths: list[int], page: int, num_blocks: int
) -> None:
    used = torch.tensor([(n + page - 1) // page for n in key_lengths], device=block_table.device)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    needed = cols[None, :] < used[:, None]
    bad = needed & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, col = (int(x) for x in bad.nonzero()[0].tolist())
        raise _fail(
            fn,
            f"block_table[{b}, {col}] = {int(block_table[b, col])} is not a block id in [0, "
            f"{num_blocks}) but sequence {b} needs that block for its {key_lengths[b]} key(s); fill "
            "the first ceil(length / block_size) entries of each row with valid block ids",
        )


def check_varlen_lengths(
    spec: VarlenSpec,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: torch.Tensor | None,
) -> tuple[list[int], list[int]]:
    """Checks that need cu_seqlens' values; returns per-sequence query and key lengths."""
    fn = "flash_attn_varlen_func"
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    for name, cu, total in (("cu_seqlens_q", cu_q, spec.total_q), ("cu_seqlens_k", cu_k, None)):
        if cu[0] != 0:
            raise _fail(fn, f"{name}[0] must be 0, got {cu[0]}")
        for b in range(spec.batch):
            if cu[b + 1] < cu[b]:
                raise _fail(
                    fn,
                    f"{name} must be non-decreasing, but {name}[{b + 1}] = {cu[b + 1]} < "
                    f"{name}[{b}] = {cu[b]}",
                )
        if total is not None and cu[-1] > total:
            raise _fail(fn, f"{name}[-1] = {cu[-1]} exceeds q.shape[0] = {total}")
    seq_q = [cu_q[b + 1] - cu_q[b] for b in range(spec.batch)]
    seq_k = [cu_k[b + 1] - cu_k[b] for b in range(spec.batch)]
    if max(seq_q) > max_seqlen_q:
        raise _fail(
            fn,
            f"max_seqlen_q = {max_seqlen_q} is smaller than the longest query ({max(seq_q)}); "
            "pass the true maximum (flash-attn would leave rows uncomputed)",
        )
    if max(seq_k) > max_seqlen_k:
        raise _fail(
            fn,
            f"max_seqlen_k = {max_seqlen_k} is smaller than the longest key sequence "
            f"({max(seq_k)}); pass the true maximum (flash-attn would drop keys)",
        )
    if spec.paged:
        for b, n in enumerate(seq_k):
            if n > spec.capacity:
                raise CapacityError(
                    f"{fn}: sequence {b} has {n} keys (cu_seqlens_k[{b + 1}] - cu_seqlens_k[{b}]) but its "
                    f"block_table row holds {spec.capacity} = block_table.shape[1] "
                    f"({spec.capacity // spec.page_size}) * block_size ({spec.page_size}); {MORE_BLOCKS}"
                )
        check_block_ids(fn, block_table, seq_k, spec.page_size, spec.num_blocks)
    elif cu_k[-1] > spec.capacity:
        raise _fail(fn, f"cu_seqlens_k[-1] = {cu_k[-1]} exceeds k.shape[0] = {spec.capacity}")
    return seq_q, seq_k
