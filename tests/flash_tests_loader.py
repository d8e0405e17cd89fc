"""Run flash-attn's own test functions (``tests/test_flash_attn.py`` of its newest PyPI sdist,
``flash_standins.FA2_TESTS``) against flashpage on CPU (test helper).

The file is read at test time from flash_standins' release cache, never copied into the project:
its imports get small stand-ins written here (an ``einops`` subset, ``flash_attn`` = flashpage's
kernels, ``bert_padding``'s pad/unpad, and a torch ``apply_rotary_emb``), ``device = "cuda"``
becomes ``"cpu"``, and the compute capability it reads at import is Hopper's. Its test functions,
``attention_ref`` and its tolerance rules then run as written.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from flash_standins import FA2_TESTS, require


# ------------------------------------------------------------------ einops subset
def _groups(side: str) -> list[list[str]]:
    out: list[list[str]] = []
    current: list[str] | None = None
    for tok in side.replace("(", " ( ").replace(")", " ) ").split():
        if tok == "(":
            current = []
        elif tok == ")":
            out.append(current)
            current = None
        elif current is not None:
            current.append(tok)
        else:
            out.append([tok])
    return out


def _einops(x: torch.Tensor, pattern: str, sizes: dict[str, int]) -> torch.Tensor:
    left, right = (_groups(s) for s in pattern.split("->"))
    n_ell = x.dim() - (len(left) - 1)

    def expand(groups: list[list[str]]) -> list[list[str]]:
        res: list[list[str]] = []
        for g in groups:
            res.extend([[f"_e{i}"] for i in range(n_ell)] if g == ["..."] else [g])
        return res

    left, right = expand(left), expand(right)
    assert len(left) == x.dim(), (pattern, tuple(x.shape))
    known = {k: int(v) for k, v in sizes.items()}
    elem: list[str] = []
    for group, n in zip(left, x.shape, strict=True):
        names = [a for a in group if a != "1"]
        unknown = [a for a in names if a not in known]
        assert len(unknown) <= 1, pattern
        if unknown:
            known[unknown[0]] = n // math.prod(known[a] for a in names if a in known)
        elem.extend(names)
    x = x.reshape([known[a] for a in elem])
    right_names = [a for g in right for a in g if a != "1"]
    x = x.permute([elem.index(a) for a in right_names if a in elem])
    view = [known[a] if a in elem else 1 for a in right_names]
    x = x.reshape(view).expand([known[a] for a in right_names])
    return x.reshape([math.prod(known[a] for a in g if a != "1") for g in right])


def rearrange(x: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
    return _einops(x, pattern, sizes)


def repeat(x: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
    return _einops(x, pattern, sizes)


# ------------------------------------------------------------------ flash_attn helpers the tests import
def unpad_input(x: torch.Tensor, mask: torch.Tensor):
    seqlens = mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:])[indices], indices, cu, int(seqlens.max()), seqlens


def pad_input(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    out = x.new_zeros(batch * seqlen, *x.shape[1:])
    out[indices] = x
    return out.reshape(batch, seqlen, *x.shape[1:])


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0, **_: Any) -> torch.Tensor:
    """x (B, S, H, D) rotated on its first 2 * cos.shape[1] dims at positions offset[b] + s."""
    batch, seqlen = x.shape[:2]
    half = cos.shape[1]
    offsets = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else torch.full((batch,), seqlen_offsets)
    pos = offsets.long()[:, None] + torch.arange(seqlen)[None]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos[pos].to(work)[:, :, None], sin[pos].to(work)[:, :, None]
    xr = x[..., : 2 * half].to(work)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    return torch.cat([rot.to(x.dtype), x[..., 2 * half:]], -1)


def _fakes() -> dict[str, types.ModuleType]:
    from flashpage.kernels import flash_attn_varlen_func, flash_attn_with_kvcache

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("not part of flashpage's contract")

    fa = types.ModuleType("flash_attn")
    fa.__path__ = []
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func"):
        setattr(fa, name, unavailable)
    fa.flash_attn_varlen_func = flash_attn_varlen_func
    fa.flash_attn_with_kvcache = flash_attn_with_kvcache
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = pad_input, unpad_input
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._get_block_size_n, interface.USE_TRITON_ROCM = unavailable, False
    layers = types.ModuleType("flash_attn.layers")
    layers.__path__ = []
    rotary = types.ModuleType("flash_attn.layers.rotary")
    rotary.apply_rotary_emb = apply_rotary_emb
    einops = types.ModuleType("einops")
    einops.rearrange, einops.repeat = rearrange, repeat
    return {"flash_attn": fa, "flash_attn.bert_padding": padding, "flash_attn.flash_attn_interface": interface,
            "flash_attn.layers": layers, "flash_attn.layers.rotary": rotary, "einops": einops}


_MODULE: list[types.ModuleType] = []


def load() -> types.ModuleType:
    """flash-attn's FA2 test module, importable on CPU, running flashpage's kernels (loaded once);
    skips the calling test when the file cannot be had."""
    if _MODULE:
        return _MODULE[0]
    path = require(FA2_TESTS)
    source = path.read_text().replace('device = "cuda"', 'device = "cpu"')
    fakes = _fakes()
    saved = {k: sys.modules.get(k) for k in fakes}
    capability = torch.cuda.get_device_capability
    sys.modules.update(fakes)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    try:
        mod = types.ModuleType("_real_fa2_tests")
        mod.__file__ = str(path)
        exec(compile(source, str(path), "exec"), mod.__dict__)
    finally:
        torch.cuda.get_device_capability = capability
        for key, old in saved.items():
            if old is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = old
    _MODULE.append(mod)
    return mod


def grid(fn: Any) -> list[dict[str, Any]]:
    """Every parameter combination of a test function's ``@pytest.mark.parametrize`` marks."""
    axes: list[tuple[list[str], list[Any]]] = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        axes.append((names, [v if len(names) > 1 else (v,) for v in values]))
    combos = []
    for choice in itertools.product(*(values for _, values in axes)):
        combo: dict[str, Any] = {}
        for (names, _), vals in zip(axes, choice, strict=True):
            combo.update(zip(names, vals, strict=True))
        combos.append(combo)
    return combos


def sample(combos: list[dict[str, Any]], n: int, seed: str, keep: Any) -> list[dict[str, Any]]:
    """``n`` combinations drawn with a fixed seed among those ``keep`` accepts, covering every value of
    every axis at least once when ``n`` allows (one pass per axis value first, then random)."""
    pool = [c for c in combos if keep(c)]
    rng = random.Random(seed)
    rng.shuffle(pool)
    chosen: list[dict[str, Any]] = []
    for axis in pool[0]:
        for value in {repr(c[axis]) for c in pool}:
            if not any(repr(c[axis]) == value for c in chosen):
                chosen.append(next(c for c in pool if repr(c[axis]) == value))
    for c in pool:
        if len(chosen) >= n:
            break
        if c not in chosen:
            chosen.append(c)
    return chosen
