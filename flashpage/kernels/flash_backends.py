"""flash-attn backends: which calls each installed flash-attn can take, and how to call it.

``problem(key, mod, call, forced)`` says why a call cannot go to flash-attn 2 ("fa2"), 3 ("fa3") or
4 ("fa4", ``flash_attn.cute.interface``), or None. ``call_kvcache`` / ``call_varlen`` take
flashpage's canonical keyword arguments (flash-attn 2.8's names, validated by the caller) and call
the installed module by keyword, with only the arguments its function's signature has (read once
per function), so every release from FA2_MIN and every FA3/FA4 interface since 2025 takes them.
What an installed version cannot express (softcap, cache_leftpad or the LSE on an old release) is
refused here, in ``problem``, so the call goes to another backend instead of failing there.

Known upstream quirks handled here (each has a contract test in tests/kernels/test_contract_flash.py):
- FA2 reshapes a one-query GQA call (``seqlenq_ngroups_swapped``) before it checks lengths and,
  in varlen, ignores cu_seqlens_q then: such calls get a window that masks nothing (left = the key
  capacity, normalised away by FA2 after the reshape decision), which switches the reshape off.
- FA2 pads a head dim that is not a multiple of 8 by copying the whole KV cache; FA3 rejects it.
- FA3 and FA4 need ``k_cache.shape[0] == batch`` without cache_batch_idx: they get the first rows.
- FA3 drops a window that masks nothing at a lower threshold than FA2, which changes where
  rotary puts the queries: such calls do not go to FA3.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from importlib import metadata
from types import ModuleType
from typing import Any, Protocol

import torch

from flashpage.kernels import validate

LABELS = {"fa2": "flash-attn", "fa3": "flash-attn 3", "fa4": "flash-attn 4"}
FA2_MIN = (2, 5, 9)  # oldest release the contract tests run through (paged varlen needs >= 2.5.7)
_NEUTRAL = (None, False, 0, 0.0, (-1, -1))


class CallProps(Protocol):
    """What eligibility depends on (dispatch._Call)."""

    entry: str
    device: torch.device
    dtype: torch.dtype
    block_size: int | None
    alibi: bool
    s_aux: bool
    softcap: bool
    leftpad: bool
    head_dim: int  # 0: not known
    features: frozenset[str]  # see kvcache_features / varlen_features


def version(mod: ModuleType) -> tuple[int, ...]:
    nums = re.findall(r"\d+", str(getattr(mod, "__version__", "0")))[:3]
    return tuple(int(x) for x in nums) or (0,)


def release(key: str, mod: ModuleType) -> str:
    """The installed version, for messages (flash-attn 4's interface module has no ``__version__``)."""
    found = getattr(mod, "__version__", None)
    if found is None and key == "fa4":
        try:
            found = metadata.version("flash-attn-4")
        except metadata.PackageNotFoundError:
            found = None
    return str(found) if found is not None else "?"


def too_old(key: str, mod: ModuleType) -> str | None:
    """Why an imported flash-attn cannot be used at all, or None."""
    if key == "fa2" and version(mod) < FA2_MIN:
        return (f"flash-attn {getattr(mod, '__version__', '?')} is too old: flashpage needs flash-attn >= "
                f"{'.'.join(map(str, FA2_MIN))} (paged KV in flash_attn_varlen_func, the oldest release its "
                "contract tests cover); pip install -U 'flash-attn>=2.5.9'")
    return None


# ------------------------------------------------------------------ signatures
_SIGNATURES: dict[Callable, tuple[frozenset[str], frozenset[str], bool]] = {}


def parameters(fn: Callable) -> tuple[frozenset[str], frozenset[str], bool]:
    """(parameter names, required ones, takes **kwargs) of ``fn``, read once per function object."""
    found = _SIGNATURES.get(fn)
    if found is None:
        params = inspect.signature(fn).parameters.values()
        names = frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        required = frozenset(p.name for p in params if p.default is p.empty and p.name in names)
        found = _SIGNATURES[fn] = (names, required, any(p.kind is p.VAR_KEYWORD for p in params))
    return found


def accepts(fn: Callable, name: str) -> bool:
    names, _, open_kwargs = parameters(fn)
    return open_kwargs or name in names


def _call(fn: Callable, kwargs: dict[str, Any]) -> tuple:
    """``fn(**kwargs)`` without the arguments its signature lacks; those must be neutral (eligibility
    refuses calls that need them), and required ``seqused_*`` arguments get None."""
    names, required, open_kwargs = parameters(fn)
    args = {}
    for name, value in kwargs.items():
        if open_kwargs or name in names:
            args[name] = value
        elif not (value is None or (not isinstance(value, torch.Tensor) and value in _NEUTRAL)):
            raise RuntimeError(f"flashpage bug: {getattr(fn, '__module__', '?')}.{fn.__name__} has no "
                               f"argument {name!r}; flash_backends.problem should have refused this call")
    for name in required - args.keys():
        if name.startswith("seqused_"):
            args[name] = None
    result = fn(**args)
    return result if isinstance(result, (tuple, list)) else (result,)


# ------------------------------------------------------------------ eligibility
def kvcache_features(spec: validate.KvcacheSpec, *, append: bool, rotary: bool, batch_idx: bool, lse: bool,
                     window: tuple[int, int], causal: bool) -> frozenset[str]:
    """What a validated flash_attn_with_kvcache call uses that some backends lack."""
    found = {name for name, on in (("append", append), ("rotary", rotary), ("batch_idx", batch_idx),
                                   ("lse", lse)) if on}
    if rotary and _fa3_moves_rotary(window, causal, spec.seqlen_q, spec.capacity):
        found.add("fa3_rotary_window")
    return frozenset(found)


def varlen_features(lse: bool) -> frozenset[str]:
    return frozenset({"lse"} if lse else ())


def _fa2_rows_rotated(window: tuple[int, int], causal: bool, seqlen_q: int, seqlen_k: int) -> bool:
    """FA2 (mha_fwd_kvcache): does rotary put query row i at position cache_seqlens + i?"""
    left, right = window
    right = 0 if causal and seqlen_q > 1 else right
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    return left >= 0 or right >= 0


def _fa3_rows_rotated(window: tuple[int, int], causal: bool, seqlen_q: int, seqlen_k: int) -> bool:
    """FA3 (hopper mha_fwd): the same question; it drops windows at seqlen_k - 1 and seqlen_q - 1."""
    left, right = window
    left = -1 if left >= seqlen_k - 1 else left
    right = -1 if right >= seqlen_q - 1 else right
    right = 0 if causal else right
    return left >= 0 or right >= 0


def _fa3_moves_rotary(window: tuple[int, int], causal: bool, seqlen_q: int, capacity: int) -> bool:
    if seqlen_q == 1:  # one row: position cache_seqlens either way
        return False
    return _fa2_rows_rotated(window, causal, seqlen_q, capacity) != _fa3_rows_rotated(
        window, causal, seqlen_q, capacity)


def _device_problem(key: str, device: torch.device, forced: bool) -> str | None:
    if forced:
        return None
    if device.type != "cuda":
        return f"device {device.type} is not CUDA ({LABELS[key]} runs on CUDA GPUs only)"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build / machine"
    major, minor = torch.cuda.get_device_capability(device)
    if key == "fa4" and major not in (9, 10, 11):
        return f"flash-attn 4 runs here on Hopper (sm90) and Blackwell (sm100/sm110) only, this one is sm{major}{minor}"
    if major < 8:
        return f"{LABELS[key]} needs an Ampere (sm80) or newer GPU, this one is sm{major}{minor}"
    return None


def preference(device: torch.device) -> tuple[str, ...]:
    """Backends in the order they are tried: flash-attn 4 first on Blackwell (its native kernels),
    else last (used where it is the only flash-attn installed)."""
    if device.type == "cuda" and torch.cuda.is_available():
        if torch.cuda.get_device_capability(device)[0] >= 10:
            return ("fa4", "fa3", "fa2")
    return ("fa3", "fa2", "fa4")


def _unsupported(key: str, call: CallProps, names: tuple[str, ...]) -> str | None:
    words = {"alibi": "ALiBi", "s_aux": "s_aux (attention sinks)", "softcap": "softcap",
             "leftpad": "cache_leftpad", "append": "appending k/v", "rotary": "rotary",
             "batch_idx": "cache_batch_idx", "lse": "the softmax LSE"}
    for name in names:
        if getattr(call, name, False) or name in call.features:
            return f"{words[name]} is not supported by {LABELS[key]}"
    return None


def problem(key: str, mod: ModuleType, call: CallProps, forced: bool) -> str | None:
    """Why ``call`` cannot go to flash-attn ``key``, or None if it can."""
    if call.s_aux:
        return f"s_aux (attention sinks) is not supported by {LABELS[key]}"
    if call.dtype not in validate.FLASH_DTYPES:
        return f"dtype {str(call.dtype).replace('torch.', '')} not supported by flash-attn (fp16/bf16 only)"
    reason = _device_problem(key, call.device, forced)
    if reason:
        return reason
    return {"fa2": _fa2_problem, "fa3": _fa3_problem, "fa4": _fa4_problem}[key](mod, call)


def _fa2_problem(mod: ModuleType, call: CallProps) -> str | None:
    multiple = 128 if getattr(torch.version, "hip", None) else 256
    if call.block_size is not None and call.block_size % multiple:
        return (
            f"block_size {call.block_size} not supported by flash-attn 2 (needs a multiple of "
            f"{multiple}); use block_size={multiple} or install flash-attn 3"
        )
    cached = call.entry == "flash_attn_with_kvcache" or call.block_size is not None
    if cached and call.head_dim % 8:
        return (f"head_dim {call.head_dim} is not a multiple of 8: flash-attn 2 would copy the whole KV "
                "cache on every call to pad it")
    fn = mod.flash_attn_with_kvcache if call.entry == "flash_attn_with_kvcache" else mod.flash_attn_varlen_func
    release = getattr(mod, "__version__", "?")
    for flag, name in (("softcap", "softcap"), ("leftpad", "cache_leftpad")):
        if (getattr(call, flag) or flag in call.features) and not accepts(fn, name):
            return f"flash-attn {release} has no {name} in {fn.__name__} (needs >= 2.6); upgrade flash-attn"
    if "lse" in call.features:
        if call.entry == "flash_attn_with_kvcache" and not accepts(fn, "return_softmax_lse"):
            return f"flash-attn {release} cannot return the LSE from flash_attn_with_kvcache (needs >= 2.6)"
        if call.entry == "flash_attn_varlen_func" and version(mod) < (2, 6):
            return f"flash-attn {release} returns a padded (B, H, max_seqlen_q) varlen LSE (needs >= 2.6)"
    return None


def _fa3_problem(mod: ModuleType, call: CallProps) -> str | None:
    reason = _unsupported("fa3", call, ("alibi",))
    if reason:
        return reason
    if call.head_dim % 8:
        return f"head_dim {call.head_dim} is not a multiple of 8, which flash-attn 3 needs"
    if "fa3_rotary_window" in call.features:
        return ("flash-attn 3 drops this window (it masks nothing) and would then rotate every query at "
                "the same position, unlike flash-attn 2 and the reference")
    paged = call.block_size is not None
    if call.entry == "flash_attn_varlen_func" and not paged and "lse" in call.features:
        if not accepts(mod.flash_attn_varlen_func, "return_attn_probs"):
            return "this flash-attn 3 (before PR #1851) cannot return the LSE from flash_attn_varlen_func"
    return None


def _fa4_problem(mod: ModuleType, call: CallProps) -> str | None:
    reason = _unsupported("fa4", call, ("alibi", "leftpad", "append", "rotary", "batch_idx"))
    if reason:
        return reason
    major = torch.cuda.get_device_capability(call.device)[0] if call.device.type == "cuda" else 9
    top = 256 if major == 9 else 128
    if call.head_dim and not (8 <= call.head_dim <= top and call.head_dim % 8 == 0):
        return f"head_dim {call.head_dim} not supported by flash-attn 4 here (needs 8..{top}, a multiple of 8)"
    return None


# ------------------------------------------------------------------ calls
def call_kvcache(key: str, mod: ModuleType, **kw: Any) -> tuple:
    """``flash_attn_with_kvcache`` of the installed module with canonical arguments; returns a tuple."""
    if key == "fa4":
        return _fa4_kvcache(mod, kw)
    fn = mod.flash_attn_with_kvcache
    kwargs = {name: kw[name] for name in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin",
                                          "cache_seqlens", "cache_batch_idx", "cache_leftpad", "softmax_scale",
                                          "causal", "window_size", "softcap", "rotary_interleaved", "num_splits",
                                          "return_softmax_lse")}
    if key == "fa3":
        kwargs["page_table"] = kw["block_table"]
        kwargs["k_cache"], kwargs["v_cache"] = _dense_rows(kw)  # FA3: "batch_size must be equal to batch_size_k"
        return _call(fn, kwargs)
    kwargs.update(block_table=kw["block_table"], alibi_slopes=kw["alibi_slopes"])
    if kw["k"] is not None and _fa2_swaps(kw["q"].shape[1], kw["q"].shape[2], kw["k_cache"].shape[2],
                                          kw["window_size"], kw["causal"], kw["alibi_slopes"]):
        capacity = _kvcache_capacity(kw)
        if kw["q"].shape[2] // kw["k_cache"].shape[2] > capacity:
            kwargs["window_size"] = (capacity, -1)  # masks nothing; stops the reshape that fails the length check
    return _call(fn, kwargs)


def call_varlen(key: str, mod: ModuleType, **kw: Any) -> tuple:
    """``flash_attn_varlen_func`` (FA3 paged: its ``flash_attn_with_kvcache``); returns a tuple.

    ``query_lens`` (optional, host list of per-sequence query counts) saves FA2 a read of cu_seqlens_q."""
    if key == "fa4":
        return _fa4_varlen(mod, kw)
    if key == "fa3" and kw["block_table"] is not None:
        seqlens_k = (kw["cu_seqlens_k"][1:] - kw["cu_seqlens_k"][:-1]).to(torch.int32)
        result = _call(mod.flash_attn_with_kvcache, dict(
            q=kw["q"], k_cache=kw["k"], v_cache=kw["v"], cache_seqlens=seqlens_k, page_table=kw["block_table"],
            cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=kw["max_seqlen_q"], softmax_scale=kw["softmax_scale"],
            causal=kw["causal"], window_size=kw["window_size"], softcap=kw["softcap"],
            return_softmax_lse=kw["return_attn_probs"],
        ))
        return result
    names = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
             "causal", "window_size", "softcap", "deterministic", "return_attn_probs"]
    kwargs = {name: kw[name] for name in names}
    if key == "fa3":
        return _call(mod.flash_attn_varlen_func, kwargs)
    kwargs.update(dropout_p=0.0, alibi_slopes=kw["alibi_slopes"], block_table=kw["block_table"])
    q = kw["q"]
    if _fa2_swaps(kw["max_seqlen_q"], q.shape[1], kw["k"].shape[-2], kw["window_size"], kw["causal"],
                  kw["alibi_slopes"]) and not _one_query_each(q, kw["cu_seqlens_q"], kw.get("query_lens")):
        # FA2 would reshape q to (batch, ...) and ignore cu_seqlens_q; a window that masks nothing stops it
        kwargs["window_size"] = (kw["max_seqlen_k"], -1)
    return _call(mod.flash_attn_varlen_func, kwargs)


def _fa2_swaps(seqlen_q: int, heads: int, kv_heads: int, window: tuple[int, int], causal: bool,
               alibi: torch.Tensor | None) -> bool:
    """FA2's ``seqlenq_ngroups_swapped`` condition (flash_api.cpp, kvcache and varlen)."""
    if seqlen_q != 1 or heads <= kv_heads or alibi is not None:
        return False
    return window[0] < 0 and window[1] < 0  # causal is switched off for one query row first


def _dense_rows(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense cache with more rows than the batch, without cache_batch_idx: the first ``batch`` rows
    (views), which is what sequence b reads anyway; FA3 and FA4 refuse a batch mismatch."""
    k_cache, v_cache, batch = kw["k_cache"], kw["v_cache"], kw["q"].shape[0]
    if kw["block_table"] is None and kw["cache_batch_idx"] is None and k_cache.shape[0] != batch:
        return k_cache[:batch], v_cache[:batch]
    return k_cache, v_cache


def _kvcache_capacity(kw: dict[str, Any]) -> int:
    if kw["block_table"] is not None:
        return kw["block_table"].shape[1] * kw["k_cache"].shape[1]
    return kw["k_cache"].shape[1]


def _one_query_each(q: torch.Tensor, cu_seqlens_q: torch.Tensor, query_lens: list[int] | None) -> bool:
    batch = cu_seqlens_q.shape[0] - 1
    if q.shape[0] != batch:
        return False
    lens = query_lens if query_lens is not None else (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    return all(n == 1 for n in lens)


# ------------------------------------------------------------------ flash-attn 4
def _fa4_window(window: tuple[int, int], causal: bool, seqlen_q: int, seqlen_k: int) -> tuple[bool, tuple]:
    """flashpage's (FA2) window rule as FA4 arguments: -1 -> None, FA2's normalisation applied first."""
    left, right = window
    causal = causal and seqlen_q > 1
    right = 0 if causal else right
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    if left < 0 and right == 0:
        return True, (None, None)
    return False, (left if left >= 0 else None, right if right >= 0 else None)


def _fa4_lse(result: tuple, want: bool) -> tuple:
    """FA4 marks rows with no visible key with LSE -inf; flashpage (like FA2/FA3) with +inf."""
    out, lse = result[0], result[1] if len(result) > 1 else None
    if not want:
        return (out,)
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))


def _fa4_kvcache(mod: ModuleType, kw: dict[str, Any]) -> tuple:
    q, table = kw["q"], kw["block_table"]
    k_cache, v_cache = _dense_rows(kw)
    capacity = _kvcache_capacity(kw)
    seqlens = kw["cache_seqlens"]
    if seqlens is None:
        seqlens = torch.full((q.shape[0],), capacity, dtype=torch.int32, device=q.device)
    causal, window = _fa4_window(kw["window_size"], kw["causal"], q.shape[1], capacity)
    return _fa4_lse(_call(mod.flash_attn_varlen_func, dict(
        q=q, k=k_cache, v=v_cache, seqused_k=seqlens, page_table=table,
        softmax_scale=kw["softmax_scale"], causal=causal, window_size=window, softcap=kw["softcap"],
        return_lse=kw["return_softmax_lse"])), kw["return_softmax_lse"])


def _fa4_varlen(mod: ModuleType, kw: dict[str, Any]) -> tuple:
    causal, window = _fa4_window(kw["window_size"], kw["causal"], kw["max_seqlen_q"], kw["max_seqlen_k"])
    args = dict(q=kw["q"], k=kw["k"], v=kw["v"], cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=kw["max_seqlen_q"],
                max_seqlen_k=kw["max_seqlen_k"], softmax_scale=kw["softmax_scale"], causal=causal,
                window_size=window, softcap=kw["softcap"], return_lse=kw["return_attn_probs"])
    if kw["block_table"] is not None:
        args.update(page_table=kw["block_table"],
                    seqused_k=(kw["cu_seqlens_k"][1:] - kw["cu_seqlens_k"][:-1]).to(torch.int32))
    else:
        args["cu_seqlens_k"] = kw["cu_seqlens_k"]
    return _fa4_lse(_call(mod.flash_attn_varlen_func, args), kw["return_attn_probs"])
