"""Public kernel entry points: validate, check capacity, then run flash-attn 3, flash-attn 2 or the
PyTorch reference, whichever is importable and eligible for the inputs.

flash-attn is imported lazily, once; an ImportError or any other exception raised while importing
(a broken install missing flash_attn_2_cuda, say) never escapes: it becomes the reason string that
backend_info() reports. flash-attn is always called with keyword arguments.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch

from flashpage.kernels import cpu_attention, flash_backends, reference, validate
from flashpage.kernels.paged import LayerOptions
from flashpage.kernels.store import store_kv as _store_kv

ENTRY_POINTS = ("flash_attn_with_kvcache", "flash_attn_varlen_func", "store_kv")
_MODULES = {"fa2": "flash_attn", "fa3": "flash_attn_interface", "fa4": "flash_attn.cute.interface"}
_LABELS = flash_backends.LABELS
_imports: dict[str, tuple[ModuleType | None, str]] = {}
_forced: dict[str, ModuleType] = {}
_choices: dict[_Call, tuple[BackendChoice, ModuleType | None]] = {}  # memo: cleared when backends change


@dataclass(frozen=True)
class BackendChoice:
    """Which implementation a call takes ("fa3", "fa2", "reference" or "torch") and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class _Call:
    """What eligibility depends on."""

    entry: str
    device: torch.device
    dtype: torch.dtype
    block_size: int | None  # None: dense cache / not known
    alibi: bool = False
    s_aux: bool = False
    softcap: bool = False
    leftpad: bool = False
    head_dim: int = 0  # 0: not known
    features: frozenset[str] = frozenset()  # flash_backends.kvcache_features / varlen_features


def _load(key: str) -> tuple[ModuleType | None, str]:
    """Import flash-attn 2 ("fa2"), 3 ("fa3") or 4 ("fa4") once; (module, "") or (None, why not)."""
    if "reference" in _forced:
        return None, f"{_LABELS[key]} disabled by force_backend('reference')"
    if key in _forced:
        return _forced[key], ""
    if _forced:
        return None, ""  # the other backend is switched off while one is forced
    if key not in _imports:
        try:
            mod: ModuleType | None = importlib.import_module(_MODULES[key])
            why = ""
        except ImportError as exc:
            mod, why = None, f"{_LABELS[key]} not importable: {exc}"
        except Exception as exc:  # a broken install can raise anything at import time
            mod, why = None, f"{_LABELS[key]} import failed (broken install?): {type(exc).__name__}: {exc}"
        old = flash_backends.too_old(key, mod) if mod is not None else None
        if old:
            mod, why = None, old
        _imports[key] = (mod, why)
    return _imports[key]


def clear_backend_cache() -> None:
    """Forget import results (testing hook: the next call imports flash-attn again)."""
    _imports.clear()
    _forget_choices()


def import_status(key: str) -> str:
    """"" when flash-attn ``key`` ("fa2", "fa3", "fa4") is importable and usable, else why not."""
    return _load(key)[1] or ("" if _load(key)[0] is not None else "switched off by force_backend")


@contextmanager
def force_backend(name: str, module: ModuleType | None) -> Iterator[None]:
    """Route calls to `module` as if it were flash-attn 2 ("fa2"), 3 ("fa3") or 4 ("fa4"), on any device.

    Only the device/compute-capability check is skipped; every other eligibility rule applies and
    the other flash-attn backends are disabled meanwhile. name="reference" (module ignored) sends
    every call to the PyTorch reference. Testing hook (not thread-safe).
    """
    if name not in (*_MODULES, "reference"):
        raise ValueError(f"force_backend: name must be 'fa2', 'fa3', 'fa4' or 'reference', got {name!r}")
    saved = dict(_forced)
    _forced.clear()
    _forced[name] = module
    _forget_choices()
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
        _forget_choices()


def _choose(call: _Call) -> tuple[BackendChoice, ModuleType | None]:
    """The backend for ``call`` (memoized: eligibility depends only on the call's properties)."""
    found = _choices.get(call)
    if found is None:
        found = _choices[call] = _decide(call)
    return found


def _decide(call: _Call) -> tuple[BackendChoice, ModuleType | None]:
    reasons: dict[str, str] = {}
    for key in flash_backends.preference(call.device):
        mod, why = _load(key)
        if mod is None:
            reasons[key] = why
            continue
        problem = flash_backends.problem(key, mod, call, key in _forced)
        if problem:
            reasons[key] = problem
            continue
        version = flash_backends.release(key, mod)
        detail = f"{_LABELS[key]} {version} on {call.device.type}, {str(call.dtype).replace('torch.', '')}"
        if call.block_size is not None:
            detail += f", block_size {call.block_size}"
        return BackendChoice(key, f"{key}: {detail}"), mod
    # flash-attn 2's reason first: it is the one most users install
    ordered = [reasons[key] for key in ("fa2", "fa3", "fa4") if reasons.get(key)]
    return BackendChoice("reference", _fallback_label(call) + "; ".join(ordered)), None


def _fallback_label(call: _Call) -> str:
    """How the non-flash-attn path runs ``call``: paged CPU attention of the C++ kernel's dtypes (no ALiBi) runs
    that kernel inside the reference entry point, so say so rather than "reference"."""
    paged_cpu = call.device.type == "cpu" and call.block_size is not None and not call.alibi
    if paged_cpu and call.dtype in cpu_attention.DTYPES:
        state = cpu_attention.status()
        if state.name == "cpp":
            return "cpp: fused C++ paged-attention kernel (the PyTorch reference for what it does not take); "
    return "reference: "


def explain(
    entry: str,
    *,
    device,
    dtype: torch.dtype,
    block_size: int | None = None,
    alibi: bool = False,
    s_aux: bool = False,
    softcap: bool = False,
    leftpad: bool = False,
) -> BackendChoice:
    """The backend a call of `entry` with these properties takes, and why (backend_info, in detail)."""
    if entry == "store_kv":
        return BackendChoice("torch", "torch: one indexed copy into the pages (any device, any dtype)")
    if entry not in ENTRY_POINTS:
        raise ValueError(f"explain: entry must be one of {ENTRY_POINTS}, got {entry!r}")
    call = _Call(entry, torch.device(device), dtype, block_size, alibi, s_aux, softcap, leftpad)
    return _choose(call)[0]


def backend_info(device=None, dtype=None, block_size=None) -> dict[str, BackendChoice]:
    """What each entry point would run for inputs on `device` with `dtype` and paged `block_size`.

    Defaults: device "cuda" when available else "cpu"; dtype fp16 on CUDA, else fp32; block_size
    None means "not considered" (dense caches). Returns {entry point name: BackendChoice}.
    """
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    dt = dtype if dtype is not None else (torch.float16 if dev.type == "cuda" else torch.float32)
    return {entry: explain(entry, device=dev, dtype=dt, block_size=block_size) for entry in ENTRY_POINTS}


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    s_aux=None,
):
    """flash-attn's flash_attn_with_kvcache, on flash-attn when eligible, else the exact reference.

    q: (B, Sq, H, D). k_cache, v_cache: paged (NB, P, Hk, D) with block_table (B, M) int32, or
    dense (B_cache, S_cache, Hk, D); modified in place when k, v (B, Sn, Hk, D) are given (appended
    at rows cache_seqlens[b] ..). cache_seqlens: (B,) int32 (a Python int only without block_table).
    cache_batch_idx, cache_leftpad: (B,) int32, dense only. rotary_cos/sin: (seqlen_ro, rd / 2),
    only with k/v. alibi_slopes: (H,) or (B, H) fp32. s_aux (flashpage extension): (H,) sink logits.
    dtypes fp16/bf16 (reference also fp32/fp64), all equal. Returns out (B, Sq, H, D) in q's dtype,
    and lse (B, H, Sq) fp32 (fp64 for fp64 inputs) when return_softmax_lse.
    Raises KernelInputError for inputs flash-attn rejects, CapacityError when new tokens do not fit.
    """
    window = validate.check_window("flash_attn_with_kvcache", window_size)
    spec, seqlens = validate.check_kvcache(
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
    )
    validate.check_kvcache_lengths(spec, seqlens, cache_batch_idx, cache_leftpad, block_table)
    call = _Call(
        "flash_attn_with_kvcache",
        q.device,
        q.dtype,
        spec.page_size if spec.paged else None,
        alibi_slopes is not None,
        s_aux is not None,
        bool(softcap),
        cache_leftpad is not None,
        spec.head_dim,
        flash_backends.kvcache_features(spec, append=k is not None, rotary=rotary_cos is not None,
                                        batch_idx=cache_batch_idx is not None, lse=bool(return_softmax_lse),
                                        window=window, causal=bool(causal)),
    )
    choice, mod = _choose(call)
    if choice.name == "reference":
        return reference.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=seqlens,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
            softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
            rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
            return_softmax_lse=return_softmax_lse, s_aux=s_aux, spec=spec,
        )
    result = flash_backends.call_kvcache(
        choice.name, mod, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, cache_seqlens=seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits,
        return_softmax_lse=return_softmax_lse,
    )
    return (result[0], result[1]) if return_softmax_lse else result[0]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    s_aux=None,
):
    """flash-attn's flash_attn_varlen_func (forward only), on flash-attn when eligible, else the reference.

    q: (total_q, H, D) packed by cu_seqlens_q (B + 1,) int32. With block_table (B, M) int32, k and v
    are the paged caches (NB, P, Hk, D) and sequence b reads cu_seqlens_k[b + 1] - cu_seqlens_k[b]
    keys from logical row 0 of block_table[b] (no append: store_kv first). Without block_table, k and
    v are packed (total_k, Hk, D) split by cu_seqlens_k. max_seqlen_q/k: ints >= the true maxima.
    dropout_p must be 0. alibi_slopes: (H,) or (B, H) fp32. s_aux: (H,) sink logits (extension).
    Returns out (total_q, H, D), or (out, lse (H, total_q) fp32, None) when return_attn_probs.
    """
    window = validate.check_window("flash_attn_varlen_func", window_size)
    spec = validate.check_varlen(
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
    )
    seq_q, seq_k = validate.check_varlen_lengths(
        spec, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table
    )
    call = _Call(
        "flash_attn_varlen_func",
        q.device,
        q.dtype,
        spec.page_size if spec.paged else None,
        alibi_slopes is not None,
        s_aux is not None,
        bool(softcap),
        False,
        spec.head_dim,
        flash_backends.varlen_features(bool(return_attn_probs)),
    )
    choice, mod = _choose(call)
    if choice.name == "reference":
        return reference.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window,
            softcap=softcap, alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs,
            block_table=block_table, s_aux=s_aux, spec=spec, seq_q=seq_q, seq_k=seq_k,
        )
    result = flash_backends.call_varlen(
        choice.name, mod, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
        return_attn_probs=return_attn_probs, block_table=block_table, query_lens=seq_q,
    )
    return (result[0], result[1], None) if return_attn_probs else result[0]


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter k (T, Hk, D) and v (T, Hk, Dv) into k_cache (NB, P, Hk, D) and v_cache (NB, P, Hk, Dv)
    at slot_mapping (T,) (-1 = skip). Never recorded by autograd: the pages are long-lived buffers."""
    with torch.no_grad():
        _store_kv(k_cache, v_cache, k, v, slot_mapping)


# ------------------------------------------------------------------ the layer path
@dataclass(frozen=True)
class LayerKernel:
    """A flash-attn backend bound for the layer path: calls on inputs a step plan validated."""

    name: str
    module: ModuleType

    def kvcache(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                seqlens_k: torch.Tensor, opts: LayerOptions) -> torch.Tensor:
        """flash_attn_with_kvcache on pages that already hold this step's K/V: (B, Sq, H, Dv)."""
        return flash_backends.call_kvcache(
            self.name, self.module, q=q, k_cache=k_pages, v_cache=v_pages, k=None, v=None, rotary_cos=None,
            rotary_sin=None, cache_seqlens=seqlens_k, cache_batch_idx=None, cache_leftpad=None,
            block_table=block_table, softmax_scale=opts.softmax_scale, causal=opts.causal,
            window_size=opts.window_size, softcap=opts.softcap, rotary_interleaved=True, alibi_slopes=None,
            num_splits=0, return_softmax_lse=False,
        )[0]


_layer_kernels: dict[tuple, LayerKernel | None] = {}


def _forget_choices() -> None:
    """Drop every memoized choice (the installed or forced backends changed)."""
    _choices.clear()
    _layer_kernels.clear()


def layer_kernel(device: torch.device, dtype: torch.dtype, block_size: int, s_aux: bool,
                 softcap: bool, head_dim: int = 0) -> LayerKernel | None:
    """The flash-attn kernel a layer's paged ``kvcache``-mode attention runs on, or None for the
    reference (:func:`flashpage.kernels.paged.attend_static`). Memoized: one dict lookup per call."""
    key = (device, dtype, block_size, s_aux, softcap, head_dim)
    if key not in _layer_kernels:
        call = _Call("flash_attn_with_kvcache", device, dtype, block_size, False, s_aux, softcap, False, head_dim)
        choice, mod = _choose(call)
        _layer_kernels[key] = None if mod is None else LayerKernel(choice.name, mod)
    return _layer_kernels[key]


def layer_varlen(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, block_table: torch.Tensor,
                 opts: LayerOptions, s_aux: torch.Tensor | None, query_lens: list[int], key_lens: list[int],
                 block_size: int) -> torch.Tensor:
    """Paged ``flash_attn_varlen_func`` on a plan's validated tensors (q (T, H, D) -> (T, H, Dv)).

    ``query_lens`` / ``key_lens`` are the host copies of the lengths, so the reference never
    reads them back from the device."""
    call = _Call("flash_attn_varlen_func", q.device, q.dtype, block_size, opts.alibi_slopes is not None,
                 s_aux is not None, opts.softcap > 0, False, q.shape[-1])
    choice, mod = _choose(call)
    if mod is not None:
        return flash_backends.call_varlen(
            choice.name, mod, q=q, k=k_pages, v=v_pages, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=opts.softmax_scale,
            causal=opts.causal, window_size=opts.window_size, softcap=opts.softcap, alibi_slopes=opts.alibi_slopes,
            deterministic=False, return_attn_probs=False, block_table=block_table, query_lens=query_lens,
        )[0]
    if (q.device.type == "cpu" and opts.alibi_slopes is None and not torch.compiler.is_compiling()
            and cpu_attention.eligible(q, k_pages, v_pages)):
        scale = q.shape[-1] ** -0.5 if opts.softmax_scale is None else float(opts.softmax_scale)
        mask = reference.normalize_mask(opts.causal, opts.window_size, max_seqlen_q, max_seqlen_k, False, scale,
                                        float(opts.softcap))  # flash-attn's: a window >= max_seqlen_k is unbounded
        out = reference.cpu_kernel(q, k_pages, v_pages, block_table, cu_seqlens_k.diff(), cu_seqlens_q, mask, s_aux)
        if out is not None:
            return out[0]
    spec = validate.VarlenSpec(batch=len(query_lens), total_q=q.shape[0], heads=q.shape[1],
                               kv_heads=k_pages.shape[2], head_dim=q.shape[2], paged=True, page_size=block_size,
                               num_blocks=k_pages.shape[0], capacity=block_table.shape[1] * block_size)
    return reference.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=opts.softmax_scale, causal=opts.causal,
        window_size=opts.window_size, softcap=opts.softcap, alibi_slopes=opts.alibi_slopes, return_attn_probs=False,
        block_table=block_table, s_aux=s_aux, spec=spec, seq_q=query_lens, seq_k=key_lens,
    )

