"""oneDNN for the engine's float32 linears on CPU (what vLLM's CPU backend does).

torch's ``F.linear`` on CPU float32 calls MKL's sgemm, which on some CPUs (AMD EPYC here) runs
2-2.3x slower than oneDNN's matmul on the same shapes (measured: x (256, 512) @ W (1376, 512)^T,
1 thread: 24.8 ms vs 10.8 ms; (32, 512) @ (8192, 512)^T: 31.3 vs 14.2 ms). Linears are 55-60% of an
engine step on CPU (``flashpage bench breakdown``), so ``LLM`` runs them through
``torch.ops.mkldnn._linear_pointwise`` during its own eager forwards.

How: each eligible ``nn.Linear`` (CPU, float32, 2-D weight, no forward override of its own) gets an
instance ``forward`` that takes oneDNN only inside :func:`onednn_scope` on the calling thread, and
``F.linear`` everywhere else (``model.generate()``, training, another thread, torch.compile traces:
inductor cannot lower the op on non-constant weights), so the model outside the engine computes
exactly what it did. Results differ from MKL's by float32 rounding (~1e-6 relative), like any two
GEMM libraries. ``FLASHPAGE_CPU_LINEAR=torch`` turns it off.
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
    """(..., in) -> (..., out): oneDNN inside an engine step on this thread, else F.linear."""
    if not torch.compiler.is_compiling() and _active() and x.dtype == torch.float32:  # traced: F.linear
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
