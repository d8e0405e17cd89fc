"""The packed-step attention as one opaque op, for a compiled engine step of any kind.

A compiled engine step (``flashpage.engine.compiled.CompiledStep``) runs the packed [1, T] forward
of prefill chunks and decodes together, with T padded to a size bucket. Only the token dimension
T reaches the graph: the step's sequences, block tables and lengths (which change every step)
stay outside it, in the step the caller makes current with :func:`current_step` around the call,
as vLLM's attention op reads its forward context. At run time :func:`attend_packed_op` hands the
first T real query rows to that step's eager ``attend`` (flash-attn or the exact PyTorch kernels,
whatever the eager path runs) and returns zeros for the padding rows. No cache import here: the
step is any object with ``input_slots`` (T,) and ``attend(query (1, H, T, D), k_pages, v_pages,
opts, s_aux) -> (1, T, H, Dv)`` (``flashpage.plan.DeviceStep`` of a packed plan).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from flashpage.kernels.paged import LayerOptions


class PackedAttention(Protocol):
    """What :func:`attend_packed_op` calls: a step's eager attention over its T real tokens."""

    input_slots: torch.Tensor  # (T,): one per real input token

    def attend(self, query: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
               s_aux: torch.Tensor | None = None) -> torch.Tensor: ...


_CURRENT = threading.local()


@contextlib.contextmanager
def current_step(step: PackedAttention) -> Iterator[None]:
    """Make ``step`` the one :func:`attend_packed_op` attends with, on this thread, inside the block."""
    previous = getattr(_CURRENT, "step", None)
    _CURRENT.step = step
    try:
        yield
    finally:
        _CURRENT.step = previous


def _current() -> PackedAttention:
    step = getattr(_CURRENT, "step", None)
    if step is None:
        raise RuntimeError("flashpage::attend_packed ran outside flashpage.kernels.packed.current_step(...): "
                           "only a compiled engine step (flashpage.LLM(compile=True)) may call it")
    return step


@torch.library.custom_op("flashpage::attend_packed", mutates_args=())
def attend_packed_op(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, softmax_scale: float,
                     causal: bool, window_left: int, window_right: int, softcap: float,
                     s_aux: torch.Tensor | None, alibi_slopes: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """Attention of a packed step's queries q (Tp, H, D), Tp >= T, on the pages (NB, P, Hk, D|Dv)
    through the current step (:func:`current_step`); ``softmax_scale`` < 0 means ``D ** -0.5``;
    ``s_aux`` (H,) sink logits, ``alibi_slopes`` (H,) ALiBi slopes, or None; ``chunk`` chunked attention's
    size, 0 = off (:class:`LayerOptions`).

    Returns (Tp, H, Dv): the first T rows as the step's eager attention computes them, zeros after."""
    step = _current()
    t = int(step.input_slots.shape[0])
    opts = LayerOptions(None if softmax_scale < 0 else softmax_scale, causal, (window_left, window_right), softcap,
                        alibi_slopes, chunk)
    query = q[:t].transpose(0, 1).unsqueeze(0)  # (1, H, T, D)
    out = step.attend(query, k_pages, v_pages, opts, s_aux).reshape(t, q.shape[1], v_pages.shape[-1])
    if t == q.shape[0]:
        return out.contiguous()
    full = out.new_zeros((q.shape[0], q.shape[1], v_pages.shape[-1]))
    full[:t] = out
    return full


@attend_packed_op.register_fake
def _attend_packed_fake(q, k_pages, v_pages, softmax_scale, causal, window_left, window_right, softcap,
                        s_aux, alibi_slopes, chunk) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v_pages.shape[-1]))


def attend_packed(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, opts: LayerOptions,
                  s_aux: torch.Tensor | None) -> torch.Tensor:
    """:func:`attend_packed_op` with the layer's options. q (Tp, H, D) -> (Tp, H, Dv)."""
    scale = -1.0 if opts.softmax_scale is None else float(opts.softmax_scale)
    return attend_packed_op(q, k_pages, v_pages, scale, opts.causal, opts.window_size[0], opts.window_size[1],
                            float(opts.softcap), s_aux, opts.alibi_slopes, int(opts.chunk))

