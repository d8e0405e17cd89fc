"""flash-attn backends: which calls each installed flash-attn can take, and how to call it.

``problem(key, mod, call, forced)`` says why a call cannot go to flash-attn 2 ("fa2") or 3
("fa3"), or None. ``call_kvcache`` / ``call_varlen`` take flashpage's canonical keyword arguments
(flash-attn 2.8's names, validated by the caller) and call the installed module with the
arguments its version knows, always by keyword.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any, Protocol

import torch

from flashpage.kernels import validate

LABELS = {"fa2": "flash-attn", "fa3": "flash-attn 3"}
FA2_MIN = (2, 5, 7)  # first release with block_table in flash_attn_varlen_func
FA2_SOFTCAP = (2, 6, 0)  # softcap and cache_leftpad arguments


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


def version(mod: ModuleType) -> tuple[int, ...]:
    nums = re.findall(r"\d+", str(getattr(mod, "__version__", "0")))[:3]
    return tuple(int(x) for x in nums) or (0,)


def too_old(key: str, mod: ModuleType) -> str | None:
    """Why an imported flash-attn cannot be used at all, or None."""
    if key == "fa2" and version(mod) < FA2_MIN:
        return (f"flash-attn {getattr(mod, '__version__', '?')} is too old (paged KV needs >= "
                f"{'.'.join(map(str, FA2_MIN))}); upgrade flash-attn")
    return None


def _device_problem(key: str, device: torch.device, forced: bool) -> str | None:
    if forced:
        return None
    if device.type != "cuda":
        return f"device {device.type} is not CUDA ({LABELS[key]} runs on CUDA GPUs only)"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build / machine"
    major, minor = torch.cuda.get_device_capability(device)
    if key == "fa3" and major != 9:
        return f"flash-attn 3 needs a Hopper GPU (sm90), this one is sm{major}{minor}"
    if major < 8:
        return f"flash-attn needs an Ampere (sm80) or newer GPU, this one is sm{major}{minor}"
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
    if key == "fa3":
        return "ALiBi is not supported by flash-attn 3" if call.alibi else None
    multiple = 128 if getattr(torch.version, "hip", None) else 256
    if call.block_size is not None and call.block_size % multiple:
        return (
            f"block_size {call.block_size} not supported by flash-attn 2 (needs a multiple of "
            f"{multiple}); use block_size={multiple} or install flash-attn 3"
        )
    if (call.softcap or call.leftpad) and version(mod) < FA2_SOFTCAP:
        return f"flash-attn {getattr(mod, '__version__', '?')} has no softcap/cache_leftpad (needs >= 2.6)"
    return None


def _as_tuple(result: Any) -> tuple:
    return result if isinstance(result, (tuple, list)) else (result,)


def call_kvcache(key: str, mod: ModuleType, **kw: Any) -> tuple:
    """``mod.flash_attn_with_kvcache`` with flashpage's canonical arguments; returns a tuple."""
    kwargs = {name: kw[name] for name in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin",
                                          "cache_seqlens", "cache_batch_idx", "softmax_scale", "causal",
                                          "window_size", "rotary_interleaved", "num_splits", "return_softmax_lse")}
    if key == "fa3":
        kwargs.update(page_table=kw["block_table"], cache_leftpad=kw["cache_leftpad"], softcap=kw["softcap"])
    else:
        kwargs.update(block_table=kw["block_table"], alibi_slopes=kw["alibi_slopes"])
        if version(mod) >= FA2_SOFTCAP:
            kwargs.update(cache_leftpad=kw["cache_leftpad"], softcap=kw["softcap"])
    return _as_tuple(mod.flash_attn_with_kvcache(**kwargs))


def call_varlen(key: str, mod: ModuleType, **kw: Any) -> tuple:
    """``mod.flash_attn_varlen_func`` (FA3 paged: its ``flash_attn_with_kvcache``); returns a tuple."""
    if key == "fa3" and kw["block_table"] is not None:
        seqlens_k = (kw["cu_seqlens_k"][1:] - kw["cu_seqlens_k"][:-1]).to(torch.int32)
        return _as_tuple(mod.flash_attn_with_kvcache(
            q=kw["q"], k_cache=kw["k"], v_cache=kw["v"], cache_seqlens=seqlens_k, page_table=kw["block_table"],
            cu_seqlens_q=kw["cu_seqlens_q"], max_seqlen_q=kw["max_seqlen_q"], softmax_scale=kw["softmax_scale"],
            causal=kw["causal"], window_size=kw["window_size"], softcap=kw["softcap"],
            return_softmax_lse=kw["return_attn_probs"],
        ))
    names = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
             "causal", "window_size", "deterministic", "return_attn_probs"]
    kwargs = {name: kw[name] for name in names}
    if key == "fa3":
        kwargs["softcap"] = kw["softcap"]
        return _as_tuple(mod.flash_attn_varlen_func(**kwargs))
    kwargs.update(dropout_p=0.0, alibi_slopes=kw["alibi_slopes"], block_table=kw["block_table"])
    if version(mod) >= FA2_SOFTCAP:
        kwargs["softcap"] = kw["softcap"]
    return _as_tuple(mod.flash_attn_varlen_func(**kwargs))
