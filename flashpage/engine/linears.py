"""oneDNN for the engine's float32 linears on CPU (what vLLM's CPU backend does).

torch's ``F.linear`` on CPU float32 calls MKL's sgemm, which on some CPUs (AMD EPYC here) runs
2-2.3x slower than oneDNN's matmul on the same shapes (measured: x (256, 512) @ W (1376, 512)^T,
1 thread: 24.8 ms vs 10.8 ms; (32, 512) @ (8192, 512)^T: 31.3 vs 14.2 ms). Linears are 55-60% of an
engine step on CPU (``flashpage bench breakdown``), so ``LLM`` runs them through
``torch.ops.mkldnn._linear_pointwise`` during its own eager forwards.

How: each eligible ``nn.Linear`` (CPU, float32, 2-D weight, no forward override of its own) gets an
instance ``forward`` that takes oneDNN only inside :func:`onednn_scope` on the calling thread, and
``F.linear`` everywhere else (``model.generate()``, training, another thread, torch.compile traces
other than the engine's: inductor cannot lower the op on non-constant weights), so the model outside
the engine computes exactly what it did. A compiled engine step traces them to the opaque
``flashpage::onednn_linear`` op (:func:`compiled_scope`). Results differ from MKL's by float32
rounding (~1e-6 relative), like any two GEMM libraries. ``FLASHPAGE_CPU_LINEAR=torch`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

_STATE = threading.local()
ENV = "FLASHPAGE_CPU_LINEAR"


def _active() -> bool:
    return getattr(_STATE, "depth", 0) > 0


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """(..., in) -> (..., out): oneDNN inside an engine step on this thread (traced: inside a compiled
    engine step, as an opaque op), else F.linear."""
    if torch.compiler.is_compiling():
        if _COMPILED_ONEDNN and x.dtype == torch.float32:
            return onednn_linear_op(x, self.weight, self.bias)
    elif _active() and x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
    return F.linear(x, self.weight, self.bias)


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear and it computes F.linear's result (checked once)."""
    if os.environ.get(ENV, "").lower() == "torch":
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5))


def install_onednn_linears(model: Any) -> int:
    """Give the model's eligible linears the scoped oneDNN forward (idempotent); returns how many have it."""
    if not onednn_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        own = vars(module).get("forward")
        if own is not None and getattr(own, "__func__", None) is _onednn_forward:
            count += 1
            continue
        w = module.weight
        if own is not None or w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
            continue
        module.forward = types.MethodType(_onednn_forward, module)
        count += 1
    return count


@contextlib.contextmanager
def onednn_scope(enabled: bool = True) -> Iterator[None]:
    """Linears with the oneDNN forward use it inside this block, on this thread."""
    if not enabled:
        yield
        return
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


# ------------------------------------------------------------------ compiled graphs
# Inductor lowers F.linear on CPU to MKL's sgemm (the slow library here), and cannot lower
# mkldnn._linear_pointwise on weights that are graph inputs (only frozen ones, which would go stale
# when the weights change). A compiled engine step therefore calls oneDNN through this opaque op,
# which reads the current weights on every call.
_COMPILED_ONEDNN = False  # a plain global: dynamo guards on its value (thread-locals break the graph)


@torch.library.custom_op("flashpage::onednn_linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ weight (out, in)^T + bias (out,) through oneDNN: (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


@onednn_linear_op.register_fake
def _onednn_linear_fake(x, weight, bias) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def compiled_onednn() -> bool:
    """Whether a forward being traced now should call :func:`onednn_linear_op` (see :func:`compiled_scope`)."""
    return _COMPILED_ONEDNN


@contextlib.contextmanager
def compiled_scope(enabled: bool = True) -> Iterator[None]:
    """Linears with the oneDNN forward trace to :func:`onednn_linear_op` inside this block (on this thread)."""
    global _COMPILED_ONEDNN
    previous = _COMPILED_ONEDNN
    _COMPILED_ONEDNN = enabled
    try:
        yield
    finally:
        _COMPILED_ONEDNN = previous
