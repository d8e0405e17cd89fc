"""Fewer eager ops per engine step: fused norms, rotary and gated-MLP activations in the HF modules.

An eager transformers forward runs RMSNorm as ~8 small ops, ``apply_rotary_pos_emb`` as ~16 and
``act_fn(gate) * up`` through an activation module; on CPU each op costs several microseconds of
dispatch before any arithmetic. Inside :func:`fastpath_scope` (the engine's eager forwards, on the
calling thread) these run as fewer ops:

- **norms**: a module whose forward a probe proves equal (random inputs and weights, float32) to
  ``F.rms_norm(x, w)`` (Llama, Qwen, Mistral...), ``F.rms_norm(x, 1 + w)`` (Gemma) or a bias-free
  ``F.layer_norm`` (Cohere) calls that one op;
- **rotary**: a modeling module's ``apply_rotary_pos_emb`` that a probe proves equal to
  ``q * cos + rotate_half(q) * sin`` runs as ``addcmul(q * cos, q.roll(D/2), sin_signed)``, with
  ``sin_signed`` (the first half negated) built once per step and shared by every layer;
- **gated MLPs**: ``down(act(gate(x)) * up(x))`` (act a probed silu / gelu; gate and up from two linears,
  or the two halves of one ``gate_up_proj``: Phi-3, GLM) with the activation (silu, unless the gate output
  is a view of another tensor) and the product in place, no activation module call.

Where the one-pass C++ ops of :mod:`flashpage.kernels.cpu_fused` load (a compiler and ninja; built
once per machine), CPU float32 steps run the RMS norms, the silu / gelu(tanh) gated products and the
rotary as one C++ call each instead (a norm: 1 pass over the rows instead of ~6; silu-and-mul reads the
fused gate|up GEMM's two halves in place); each probe then also checks the C++ form against the
module's own forward, and a form that fails keeps the torch ops. Centred norms (Cohere) and exact-erf
gelu stay on torch ops.

Outside the scope (``model.generate()``, training, other threads, torch.compile traces) every patched
forward calls the module's own code, so the model computes exactly what it did. float32 activations take the
fused torch forms or the C++ ops; bfloat16 / float16 activations take only the C++ ops, which round where the
modules' own half-precision ops round (:mod:`flashpage.kernels.cpu_fused`), and only where a second probe in
those dtypes proves it (the module's own forward on half inputs, at most one rounding step apart in at most 1 in
20 elements: a norm's rounding order is picked by it); otherwise the module's own forward runs.
Results differ from the modules' own by float32 rounding (probe tolerance 1e-5). The probes run on small
stand-ins (a norm's shallow copy with a random weight of its own, an MLP's 32-wide slices), never on a deep
copy: a patched module's ``_flashpage_state`` holds the whole model. ``FLASHPAGE_FASTPATH=0`` turns it off;
``FLASHPAGE_FASTPATH=torch`` keeps the fused torch forms but not the C++ ops (read at each engine step: an A/B
switch).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flashpage.kernels import cpu_fused

ENV = "FLASHPAGE_FASTPATH"
_STATE = threading.local()
_ATOL = _RTOL = 1e-5
_HALF = (torch.bfloat16, torch.float16)
_PROBED_DTYPES = (torch.float32, *_HALF)  # modules whose weights are of these dtypes are probed


def enabled_by_env() -> bool:
    """False when ``FLASHPAGE_FASTPATH`` is 0/false/off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def cpp_wanted() -> bool:
    """False when ``FLASHPAGE_FASTPATH=torch`` (fused torch forms only, no C++ ops)."""
    return os.environ.get(ENV, "1").strip().lower() != "torch"


def cpp_ops() -> cpu_fused.Ops | None:
    """The C++ ops for a probe of a CPU module: built (or loaded) on first use, None when unavailable or
    switched off (a model on another device never asks, so nothing is built for it)."""
    return cpu_fused.load() if cpp_wanted() else None


def _scope_ops() -> cpu_fused.Ops | None:
    """The C++ ops a step may take: those already loaded (by a probe), unless switched off (read once per
    step: an A/B switch)."""
    return cpu_fused.loaded() if cpp_wanted() else None


def _step_ops() -> cpu_fused.Ops | None:
    """The C++ ops of this step (looked up once at the scope's entry), or None."""
    return getattr(_STATE, "ops", None)


def _active() -> bool:
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def fastpath_scope(enabled: bool = True) -> Iterator[None]:
    """The patched forwards take their fused ops inside this block, on this thread."""
    if not enabled:
        yield
        return
    if getattr(_STATE, "depth", 0) == 0:
        _STATE.ops = _scope_ops()
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1
        if _STATE.depth == 0:
            _STATE.rotary = None  # the step's cos/sin: not kept alive past it


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.allclose(a, b, atol=_ATOL, rtol=_RTOL))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return False


# ---------------------------------------------------------------------------------------------- norms
@dataclass(frozen=True)
class FusedNorm:
    """How a norm module's forward is computed in one op: ``F.rms_norm(x, (dim,), w + offset, eps)``, or
    ``F.layer_norm(x, (dim,), w + offset, None, eps)`` for a bias-free mean-centred norm (Cohere);
    ``cpp``: the C++ ``rms_norm`` passed the probe too (taken when the step has the C++ ops)."""

    dim: int
    eps: float
    offset: float  # 0.0: the weight as is (Llama); 1.0: 1 + weight (Gemma)
    centred: bool = False  # layer norm (mean subtracted) rather than RMS norm
    cpp: bool = False
    half: bool = False  # bfloat16 / float16 steps take the C++ op (its rounding order matched the module's)
    round_normed: bool = True  # half precision: rounds x * scale before the weight (Llama / Qwen), else once (Gemma)


def _norm_eps(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = vars(module).get(name)
        if isinstance(value, float) and not isinstance(value, bool):
            return value
    return None


def _fused_norm(norm: FusedNorm, x: torch.Tensor, weight: torch.Tensor,
                ops: cpu_fused.Ops | None = None) -> torch.Tensor:
    """x (..., dim) float32 -> (..., dim): the norm in one op (two with a weight offset); one C++ pass
    with ``ops`` on CPU tensors without autograd."""
    if ops is not None and not norm.centred and cpu_fused.eligible(x, weight):
        return ops.rms_norm(x, weight, norm.eps, norm.offset)
    w = weight if norm.offset == 0.0 else weight + norm.offset
    if norm.centred:
        return F.layer_norm(x, (norm.dim,), w, None, norm.eps)
    return F.rms_norm(x, (norm.dim,), w, norm.eps)


def probe_norm(module: torch.nn.Module) -> FusedNorm | None:
    """The fused form of ``module`` if its own forward computes it (random x and weight, float32), else None.
    Candidates: a module with a 1-D float32 ``weight``, an ``eps`` attribute and no children (torch's own
    norm modules are one op already). ``cpp`` is set when the C++ ops load and compute it too. The forward runs on
    a stand-in with the random weight (:func:`_norm_probe`), never on a copy of the model."""
    weight = getattr(module, "weight", None)
    eps = _norm_eps(module)
    if (eps is None or not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1
            or weight.dtype not in _PROBED_DTYPES or weight.device.type == "meta" or next(module.children(), None)
            or type(module) in (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm)):
        return None
    dim = weight.shape[0]
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            probe = _norm_probe(module, torch.randn(dim, generator=g) * 0.5)
            x = torch.randn(2, 3, dim, generator=g) * 2.0 + 0.3
            want = type(module).forward(probe, x)
            for centred in (False, True):
                for offset in (0.0, 1.0):
                    fused = FusedNorm(dim, eps, offset, centred)
                    if _close(want, _fused_norm(fused, x, probe.weight)):
                        ops = None if centred or weight.device.type != "cpu" else cpp_ops()
                        cpp = ops is not None and _close(want, _fused_norm(fused, x, probe.weight, ops))
                        order = _half_norm_order(module, fused, ops) if cpp and weight.dtype in _HALF else None
                        return FusedNorm(dim, eps, offset, centred, cpp, order is not None, order is not False)
    except Exception:  # a module that is not a plain x -> norm(x) forward is simply not a candidate
        return None
    return None


def _half_norm_order(module: torch.nn.Module, norm: FusedNorm, ops: cpu_fused.Ops | None) -> bool | None:
    """For a bfloat16 / float16 norm: the C++ op's rounding order (``round_normed``) that gives the module's own
    forward in its dtype (random x and weight, at most one unit in the last place of a few elements apart), or None
    when neither does (half-precision steps then keep the module's forward)."""
    dtype = module.weight.dtype
    g = torch.Generator().manual_seed(3)
    probe = _norm_probe(module, (torch.randn(norm.dim, generator=g) * 0.5 + 1).to(dtype))
    x = (torch.randn(4, 5, norm.dim, generator=g) * 2.0 + 0.3).to(dtype)
    want = type(module).forward(probe, x)
    for round_normed in (True, False):
        got = ops.rms_norm(x, probe.weight, norm.eps, norm.offset, round_normed) if ops is not None else None
        if got is not None and _half_close(want, got):
            return round_normed
    return None


def _half_close(want: Any, got: torch.Tensor) -> bool:
    """Same shape and dtype, and at most 1 in 20 elements one rounding step of the dtype apart (the float32
    steps before a rounding may differ by an ulp between two implementations), none further."""
    if not isinstance(want, torch.Tensor) or want.shape != got.shape or want.dtype != got.dtype:
        return False
    diff = (want.float() - got.float()).abs()
    step = want.float().abs() * torch.finfo(want.dtype).eps + torch.finfo(want.dtype).tiny
    return bool((diff <= step).all()) and int((diff > 0).sum()) * 20 <= diff.numel()


def _norm_probe(module: torch.nn.Module, weight: torch.Tensor) -> torch.nn.Module:
    """A CPU stand-in of the norm ``module`` for its probe: a shallow copy whose parameter and buffer tables are
    its own, ``weight`` (a CPU tensor) as its weight and CPU clones of its other parameters and buffers (a
    childless norm's: a few vectors at most). Never a deep copy: a patched module's ``_flashpage_state`` holds the
    whole model, which a deep copy of any one of its modules copies too. The module itself is not touched."""
    probe = copy.copy(module)
    probe._parameters = {name: _cpu_parameter(weight if name == "weight" else p, p)
                         for name, p in module._parameters.items()}
    probe._buffers = {name: None if b is None else b.detach().to("cpu", copy=True)
                      for name, b in module._buffers.items()}
    return probe


def _cpu_parameter(value: torch.Tensor | None, like: torch.nn.Parameter | None) -> torch.nn.Parameter | None:
    """A CPU Parameter holding a copy of ``value``, as ``like`` requires grad (None stays None)."""
    if value is None or like is None:
        return None
    return torch.nn.Parameter(value.detach().to("cpu", copy=True), requires_grad=like.requires_grad)


def _norm_forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """x (..., dim) -> (..., dim): the fused op inside the engine's scope on float32, else the module's own."""
    if not torch.compiler.is_compiling() and _active() and not args and not kwargs:
        norm = self._flashpage_norm
        weight = _own(self, "_parameters", "weight")
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return _fused_norm(norm, x, weight, _step_ops() if norm.cpp else None)
        ops = _step_ops() if norm.half and x.dtype == weight.dtype else None
        if ops is not None and cpu_fused.eligible(x, weight):
            return ops.rms_norm(x, weight, norm.eps, norm.offset, norm.round_normed)
    return type(self).forward(self, x, *args, **kwargs)


def _own(module: torch.nn.Module, table: str, name: str) -> Any:
    """``getattr(module, name)`` for a parameter (``table`` "_parameters") or child module ("_modules"): read from
    its table first (a plain dict read; ``nn.Module.__getattr__``, the path attribute access takes to them, costs
    a Python call per read on the hot path), else the attribute as it is (one set outside the table)."""
    value = module.__dict__[table].get(name)
    return value if value is not None else getattr(module, name)


# --------------------------------------------------------------------------------------------- rotary
def _rotary_tables(cos: torch.Tensor, sin: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, L, D) -> unsqueezed at ``dim`` (cos, sin with its first half negated); once per step."""
    cached = getattr(_STATE, "rotary", None)
    if cached is not None and cached[0] is cos and cached[1] is sin and cached[2] == dim:
        return cached[3], cached[4]
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(dim)
    c = cos.unsqueeze(dim)
    _STATE.rotary = (cos, sin, dim, c, signed)
    return c, signed


def _rotary_cpp_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     unsqueeze_dim: int) -> bool:
    """Whether the C++ rotary takes these: 4-D q / k, (B or 1, L, D) cos / sin, D even, CPU, no autograd."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape or unsqueeze_dim not in (1, 2):
        return False
    length = 2 if unsqueeze_dim == 1 else 1
    return (q.shape[-1] % 2 == 0 and cos.shape[0] in (1, q.shape[0]) and q.shape[0] == k.shape[0]
            and cos.shape[1] == q.shape[length] == k.shape[length] and cpu_fused.eligible(q, k, cos, sin))


def fused_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1, ops: cpu_fused.Ops | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, L, D), k (B, Hk, L, D) (or (B, L, H, D) with ``unsqueeze_dim=2``), cos/sin (B, L, D):
    ``x * cos + rotate_half(x) * sin`` for both, as ``addcmul(x * cos, roll(x, D/2), sin_signed)``, or
    one C++ pass with ``ops`` (new tensors laid out (B, L, H, D) in memory)."""
    if ops is not None and _rotary_cpp_fits(q, k, cos, sin, unsqueeze_dim):
        return ops.rotary(q, k, cos, sin, unsqueeze_dim)
    c, s = _rotary_tables(cos, sin, unsqueeze_dim)
    half = q.shape[-1] // 2
    return (torch.addcmul(q * c, q.roll(half, -1), s), torch.addcmul(k * c, k.roll(half, -1), s))


def _probe_rotary(fn: Callable[..., Any], ops: cpu_fused.Ops | None = None) -> bool:
    """Whether ``fn(q, k, cos, sin[, unsqueeze_dim=2])`` is the half-rotation RoPE of :func:`fused_rotary`
    (in its C++ form with ``ops``)."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    cos, sin = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    try:
        with torch.no_grad():
            if "unsqueeze_dim" in inspect.signature(fn).parameters:
                qt, kt = q.transpose(1, 2), k.transpose(1, 2)
                if not _close(fn(qt, kt, cos, sin, unsqueeze_dim=2),
                              _unrolled(fused_rotary, qt, kt, cos, sin, 2, ops)):
                    return False
            return _close(fn(q, k, cos, sin), _unrolled(fused_rotary, q, k, cos, sin, 1, ops))
    except Exception:  # another signature or another rotation: not a candidate
        return False


def _unrolled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` outside any step (the per-step table cache untouched)."""
    saved = getattr(_STATE, "rotary", None)
    try:
        return fn(*args)
    finally:
        _STATE.rotary = saved


def _probe_rotary_half(fn: Callable[..., Any], ops: cpu_fused.Ops | None) -> bool:
    """Whether the C++ rotary on bfloat16 and float16 inputs gives ``fn``'s own result in those dtypes (within
    :func:`_half_close`)."""
    if ops is None:
        return False
    g = torch.Generator().manual_seed(4)
    try:
        with torch.no_grad():
            for dtype in _HALF:
                q, k = torch.randn(2, 4, 5, 16, generator=g).to(dtype), torch.randn(2, 2, 5, 16, generator=g).to(dtype)
                cos, sin = torch.randn(2, 5, 16, generator=g).to(dtype), torch.randn(2, 5, 16, generator=g).to(dtype)
                want, got = fn(q, k, cos, sin), ops.rotary(q, k, cos, sin, 1)
                if not (_half_close(want[0], got[0]) and _half_close(want[1], got[1])):
                    return False
        return True
    except Exception:  # another signature or another rotation: not a candidate
        return False


def _rotary_dispatch(original: Callable[..., Any], cpp: bool, half: bool = False) -> Callable[..., Any]:
    """``original`` with the fused form taken inside the engine's scope for float32, full-width rotary;
    the C++ form where ``_flashpage_cpp`` (its probe passed) and the step has the ops; bfloat16 / float16 take the
    C++ form where ``_flashpage_half`` (:func:`_probe_rotary_half` passed), else ``original``."""

    def apply_rotary_pos_emb(*args, **kwargs):
        # only (q, k, cos, sin[, unsqueeze_dim=]) is taken; any other call (Qwen4-Exp's indexer passes the query
        # alone and cos= / sin= by keyword) goes to the original as it was made
        if (len(args) == 4 and (not kwargs or (len(kwargs) == 1 and "unsqueeze_dim" in kwargs))
                and not torch.compiler.is_compiling() and _active() and _all_tensors(args)
                and args[2].shape[-1] == args[0].shape[-1] == args[1].shape[-1]):
            q, k, cos, sin = args
            dim = kwargs.get("unsqueeze_dim", 1)
            if q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32:
                ops = _step_ops() if apply_rotary_pos_emb._flashpage_cpp else None  # type: ignore[attr-defined]
                return fused_rotary(q, k, cos, sin, dim, ops)
            ops = _step_ops() if apply_rotary_pos_emb._flashpage_half else None  # type: ignore[attr-defined]
            if (ops is not None and q.dtype in _HALF and q.dtype == k.dtype == cos.dtype == sin.dtype
                    and _rotary_cpp_fits(q, k, cos, sin, dim)):
                return ops.rotary(q, k, cos, sin, dim)  # the modules' own rounding (cpu_fused's docstring)
        return original(*args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    apply_rotary_pos_emb._flashpage_rotary = True  # type: ignore[attr-defined]
    apply_rotary_pos_emb._flashpage_cpp = cpp  # type: ignore[attr-defined]
    apply_rotary_pos_emb._flashpage_half = half  # type: ignore[attr-defined]
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _all_tensors(args: tuple[Any, ...]) -> bool:
    """Whether every item of ``args`` is a tensor (a loop: no generator frame per call on the hot path)."""
    for t in args:
        if not isinstance(t, torch.Tensor):
            return False
    return True


def _rotary_function(fn: Any) -> Callable[..., Any] | None:
    """A modeling module's ``apply_rotary_pos_emb`` as a plain function: itself, or the function a hub-kernel
    wrapper holds (from transformers 5.25, with the ``kernels`` package it requires, the global is an
    ``nn.Module`` whose ``forward`` calls the function it closes over, unless the model was kernelized); None for
    anything else."""
    if isinstance(fn, types.FunctionType):
        return fn
    if isinstance(fn, torch.nn.Module):
        try:
            inner = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        except (TypeError, ValueError):
            return None
        return inner if isinstance(inner, types.FunctionType) else None
    return None


def install_rotary(model: torch.nn.Module) -> list[str]:
    """Give the modeling modules of ``model``'s classes whose ``apply_rotary_pos_emb`` passes the probe
    the scoped fused form (a module global: the dispatcher calls the original outside the scope), with
    the C++ form where the ops load and pass the probe too. Returns the modeling modules that have it."""
    done: list[str] = []
    cpu = any(p.device.type == "cpu" for p in model.parameters())
    for name in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(name)
        fn = getattr(mod, "apply_rotary_pos_emb", None) if mod is not None else None
        plain = _rotary_function(fn)
        if plain is None:
            continue
        if getattr(fn, "_flashpage_rotary", False):
            if cpu and not fn._flashpage_cpp and (ops := cpp_ops()) is not None:  # installed while they were off
                fn._flashpage_cpp = _probe_rotary(_rotary_function(fn.__wrapped__), ops)
                fn._flashpage_half = _probe_rotary_half(_rotary_function(fn.__wrapped__), ops)
            done.append(name)
        elif _probe_rotary(plain):  # the dispatcher calls the global it replaces (a hub-kernel wrapper stays one)
            ops = cpp_ops() if cpu else None
            mod.apply_rotary_pos_emb = _rotary_dispatch(fn, ops is not None and _probe_rotary(plain, ops),
                                                        _probe_rotary_half(plain, ops))
            done.append(name)
    return done


# ------------------------------------------------------------------------------------------ gated MLPs
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu": F.gelu,
}
_IN_PLACE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": lambda t: F.silu(t, inplace=True)}


@dataclass(frozen=True)
class FusedMLP:
    """A gated MLP's fused form: its activation's name (a key of ``_ACTIVATIONS``), whether the C++
    activation-and-product passed the probe too, and whether gate and up come from one ``gate_up_proj``
    (its first half the gate: Phi-3, GLM)."""

    act: str
    cpp: bool = False
    packed: bool = False
    half: bool = False  # bfloat16 / float16 steps take the C++ activation-and-product (its probe passed)


def probe_mlp(module: torch.nn.Module) -> FusedMLP | None:
    """The fused form if ``module.forward(x)`` is ``down(act(gate(x)) * up(x))`` (checked on random x),
    else None. Candidates: ``gate_proj``, ``up_proj``, ``down_proj`` linears and an ``act_fn``; or one
    ``gate_up_proj`` linear whose output halves are gate then up, ``down_proj`` and an ``act_fn`` /
    ``activation_fn``."""
    packed = isinstance(getattr(module, "gate_up_proj", None), torch.nn.Linear)
    parts = [getattr(module, n, None) for n in (("gate_up_proj", "down_proj") if packed
                                                 else ("gate_proj", "up_proj", "down_proj"))]
    act = getattr(module, "act_fn", None)
    act = getattr(module, "activation_fn", None) if act is None else act
    if not all(isinstance(p, torch.nn.Linear) for p in parts) or not callable(act):
        return None
    if any(p.weight.dtype not in _PROBED_DTYPES or p.weight.device.type == "meta" for p in parts):
        return None
    if packed and parts[0].out_features % 2:
        return None
    g = torch.Generator().manual_seed(2)
    try:
        with torch.no_grad():
            probe = _narrow_packed_mlp(module, *parts) if packed else _narrow_mlp(module, *parts)
            x = torch.randn(2, 3, probe.down_proj.out_features, generator=g)
            want = type(module).forward(probe, x)
            both = probe.gate_up_proj(x) if packed else torch.cat((probe.gate_proj(x), probe.up_proj(x)), dim=-1)
            half = both.shape[-1] // 2
            h, u = both[..., :half], both[..., half:]  # the C++ form reads the halves of one GEMM's output
            for name, fn in _ACTIVATIONS.items():
                if _close(act(h.clone()), fn(h.clone())) and _close(want, probe.down_proj(fn(h.clone()) * u)):
                    cpu = parts[0].weight.device.type == "cpu"
                    ops = cpp_ops() if cpu and name in cpu_fused.ACTIVATIONS else None
                    cpp = ops is not None and _close(want, probe.down_proj(cpu_fused.act_and_mul(ops, h, u, name)))
                    half = cpp and parts[0].weight.dtype in _HALF and _probe_act_half(act, name, ops)
                    return FusedMLP(name, cpp, packed, half)
    except Exception:  # a forward that takes more than x, or depends on the full widths
        return None
    return None


def _probe_act_half(act: Callable[[torch.Tensor], torch.Tensor], name: str, ops: cpu_fused.Ops | None) -> bool:
    """Whether the C++ activation-and-product gives ``act(gate) * up`` (the module's own activation, in the
    dtype) in bfloat16 and float16, within :func:`_half_close`."""
    if ops is None:
        return False
    g = torch.Generator().manual_seed(5)
    for dtype in _HALF:
        h, u = (torch.randn(2, 3, 64, generator=g) * 3).to(dtype), torch.randn(2, 3, 64, generator=g).to(dtype)
        if not _half_close(act(h.clone()) * u, cpu_fused.act_and_mul(ops, h, u, name)):
            return False
    return True


def _narrow_linear(linear: torch.nn.Linear, rows: int, cols: int) -> torch.nn.Linear:
    """A CPU copy of ``linear``'s first ``rows`` outputs over its first ``cols`` inputs."""
    small = torch.nn.Linear(cols, rows, bias=linear.bias is not None)
    small.weight.copy_(linear.weight[:rows, :cols])
    if linear.bias is not None:
        small.bias.copy_(linear.bias[:rows])
    return small


def _narrow_mlp(module: torch.nn.Module, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Linear,
                width: int = 32) -> torch.nn.Module:
    """A shallow copy of ``module`` whose three linears are ``width``-wide slices of its own (the probe of a
    7B-sized MLP would otherwise run six full GEMMs: seconds per layer)."""
    hidden, inner = min(width, gate.in_features), min(width, gate.out_features)
    return _with_children(module, gate_proj=_narrow_linear(gate, inner, hidden),
                          up_proj=_narrow_linear(up, inner, hidden), down_proj=_narrow_linear(down, hidden, inner))


def _narrow_packed_mlp(module: torch.nn.Module, gate_up: torch.nn.Linear, down: torch.nn.Linear,
                       width: int = 32) -> torch.nn.Module:
    """:func:`_narrow_mlp` for one ``gate_up_proj``: the first ``width`` rows of each half."""
    half = gate_up.out_features // 2
    hidden, inner = min(width, gate_up.in_features), min(width, half)
    rows = torch.cat((torch.arange(inner), torch.arange(half, half + inner)))
    small = torch.nn.Linear(hidden, 2 * inner, bias=gate_up.bias is not None)
    small.weight.copy_(gate_up.weight[rows, :hidden])
    if gate_up.bias is not None:
        small.bias.copy_(gate_up.bias[rows])
    return _with_children(module, gate_up_proj=small, down_proj=_narrow_linear(down, hidden, inner))


def _with_children(module: torch.nn.Module, **children: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` with these children replaced, in a child table of its own (the
    model's module keeps its own children)."""
    probe = copy.copy(module)
    probe._modules = {**module._modules, **children}
    return probe


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is all of its storage (not a slice of a larger output; views are untracked in
    inference mode, so ``_base`` cannot tell)."""
    return t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """x (..., hidden) -> (..., hidden): activation and product in one C++ pass, or in place, inside the
    engine's scope (bfloat16 / float16: the C++ pass where its probe passed, else the module's own forward).
    The children are called as modules (their hooks run), read from the module's child table."""
    fused: FusedMLP = self._flashpage_mlp
    if torch.compiler.is_compiling() or args or kwargs or not _active():
        return type(self).forward(self, x, *args, **kwargs)
    if x.dtype in _HALF:
        if fused.half and x.device.type == "cpu" and (ops := _step_ops()) is not None:
            return _half_mlp(self, fused, ops, x)
        return type(self).forward(self, x)
    first = _own(self, "_modules", "gate_up_proj" if fused.packed else "gate_proj")
    if (x.dtype == torch.float32 and torch.is_inference_mode_enabled()
            and _own(first, "_parameters", "weight").dtype == torch.float32):
        return _float_mlp(self, fused, first, x)
    return type(self).forward(self, x)


def _half_mlp(self: torch.nn.Module, fused: FusedMLP, ops: cpu_fused.Ops, x: torch.Tensor) -> torch.Tensor:
    """:func:`_mlp_forward` on bfloat16 / float16 ``x``: the C++ activation-and-product."""
    code = cpu_fused.ACTIVATIONS[fused.act]
    down = _own(self, "_modules", "down_proj")
    if fused.packed:
        both = _own(self, "_modules", "gate_up_proj")(x)
        half = both.shape[-1] // 2
        return down(ops.act_and_mul(both[..., :half], both[..., half:], code))
    return down(ops.act_and_mul(_own(self, "_modules", "gate_proj")(x), _own(self, "_modules", "up_proj")(x), code))


def _float_mlp(self: torch.nn.Module, fused: FusedMLP, first: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """:func:`_mlp_forward` on float32 ``x`` (``first``: the gate or gate|up linear): the C++ activation-and-product
    where the step has the ops, else the activation and product in place."""
    ops = _step_ops() if fused.cpp and x.device.type == "cpu" else None
    down = _own(self, "_modules", "down_proj")
    if fused.packed:
        both = first(x)
        half = both.shape[-1] // 2
        gate, up = both[..., :half], both[..., half:]
        if ops is not None:
            return down(ops.act_and_mul(gate, up, cpu_fused.ACTIVATIONS[fused.act]))
        return down(_ACTIVATIONS[fused.act](gate).mul_(up))  # a tensor of our own, then in place
    gate = first(x)
    up_proj = _own(self, "_modules", "up_proj")
    if ops is not None:  # gate / up may be views of one fused GEMM output
        return down(ops.act_and_mul(gate, up_proj(x), cpu_fused.ACTIVATIONS[fused.act]))
    act = _IN_PLACE.get(fused.act) if _owns_storage(gate) else None  # never into a view
    h = act(gate) if act is not None else _ACTIVATIONS[fused.act](gate)  # a tensor of our own
    return down(h.mul_(up_proj(x)))


# ------------------------------------------------------------------------------------------- install
@dataclass(frozen=True)
class FastPath:
    """What :func:`install_fastpath` gave a model: counts of fused modules, modules with fused rotary, and
    how many of those forms (norm / MLP modules, rotary modules) passed the probe of their C++ form."""

    norms: int = 0
    mlps: int = 0
    rotary: tuple[str, ...] = ()
    cpp: int = 0

    @property
    def any(self) -> bool:
        return bool(self.norms or self.mlps or self.rotary)

    def describe(self) -> str:
        return (f"{self.norms} norms, {self.mlps} gated MLPs, rotary in {len(self.rotary)} modeling module(s)"
                f"; {self.cpp} of these in C++")


def _install_forward(module: torch.nn.Module, forward: Callable[..., Any], attr: str, value: Any) -> bool:
    own = vars(module).get("forward")
    if own is not None:
        return getattr(own, "__func__", None) is forward  # ours already, or someone else's: left alone
    setattr(module, attr, value)
    module.forward = types.MethodType(forward, module)
    return True


def _recheck(module: torch.nn.Module, attr: str, probe: Callable[[torch.nn.Module], Any]) -> None:
    """An installed module whose C++ form was not probed (the ops were off then): probe it now if they load."""
    if (not getattr(module, attr).cpp and all(p.device.type == "cpu" for p in module.parameters())
            and cpp_ops() is not None):
        fresh = probe(module)
        if fresh is not None and fresh.cpp:
            setattr(module, attr, fresh)


def uninstall_fastpath(model: torch.nn.Module) -> int:
    """Take the fused norm / MLP forwards :func:`install_fastpath` gave ``model``'s modules back off (each is a
    bound method of its module: a reference cycle); returns how many. The rotary dispatchers are module globals
    of the modeling code, shared by every model of the class, and stay."""
    removed = 0
    for module in model.modules():
        for forward, attr in ((_norm_forward, "_flashpage_norm"), (_mlp_forward, "_flashpage_mlp")):
            if getattr(vars(module).get("forward"), "__func__", None) is forward:
                del module.forward
                vars(module).pop(attr, None)
                removed += 1
    return removed


def install_fastpath(model: torch.nn.Module) -> FastPath:
    """Probe every norm and gated MLP of ``model`` and the rotary of its modeling modules; give those that
    pass the scoped fused forward (idempotent). Nothing changes when ``FLASHPAGE_FASTPATH=0``."""
    if not enabled_by_env():
        return FastPath()
    norms = mlps = 0
    for module in model.modules():
        if getattr(vars(module).get("forward"), "__func__", None) is _norm_forward:
            _recheck(module, "_flashpage_norm", probe_norm)
            norms += 1
            continue
        if getattr(vars(module).get("forward"), "__func__", None) is _mlp_forward:
            _recheck(module, "_flashpage_mlp", probe_mlp)
            mlps += 1
            continue
        fused = probe_norm(module)
        if fused is not None:
            norms += _install_forward(module, _norm_forward, "_flashpage_norm", fused)
            continue
        mlp = probe_mlp(module)
        if mlp is not None:
            mlps += _install_forward(module, _mlp_forward, "_flashpage_mlp", mlp)
    rotary = tuple(install_rotary(model))
    cpp = sum(getattr(vars(m).get(attr), "cpp", False) for m in model.modules()
              for attr in ("_flashpage_norm", "_flashpage_mlp"))
    cpp += sum(sys.modules[name].apply_rotary_pos_emb._flashpage_cpp for name in rotary)
    return FastPath(norms=norms, mlps=mlps, rotary=rotary, cpp=cpp)
