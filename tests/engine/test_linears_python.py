"""The float32 oneDNN linear path's Python (engine/linears.py): the op bound once at import is oneDNN's linear
itself, the padded packed call keeps its row rule, and a fused group hands out exactly the views of one split of
its GEMM (each once per input), bit for bit what the separate steps of the original code computed."""

from __future__ import annotations

import pytest
import torch

from flashpage.engine import linears

pytestmark = [pytest.mark.skipif(not linears.onednn_available(), reason="this torch has no oneDNN linear"),
              pytest.mark.usefixtures("one_thread")]


def _reference_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The packed call as first written: rows counted, fewer than PACKED_MIN_ROWS padded, through the packet."""
    op = torch.ops.mkldnn._linear_pointwise
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows < linears.PACKED_MIN_ROWS:
        return op(x.contiguous(), weight, bias, "none", [], "")
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(linears.PACKED_MIN_ROWS - rows, x.shape[-1])])
    return op(padded, weight, bias, "none", [], "")[:rows].reshape(*x.shape[:-1], -1)


def test_bound_op_is_onednns_linear():
    assert linears._LINEAR_POINTWISE is torch.ops.mkldnn._linear_pointwise.default
    x, w, b = torch.randn(5, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(linears._linear_call(x, w, b), torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""))


@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (4, 24), (5, 24), (1, 1, 24), (1, 3, 24), (2, 2, 24),
                                   (2, 4, 24), (0, 24), (1, 0, 24)])
def test_packed_call_same_bits_as_the_row_rule(shape):
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, linears.PACK_BATCH_HINT)
    x = torch.randn(*shape, generator=gen)
    got = linears._packed_call(x, packed, b)
    assert got.shape == (*shape[:-1], 40)
    assert torch.equal(got, _reference_packed(x, packed, b))
    t = torch.randn(24, 6, generator=gen).t()  # not contiguous: made so before the call
    assert torch.equal(linears._packed_call(t, packed, b), _reference_packed(t, packed, b))


class _Siblings(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(16, 8), torch.nn.Linear(16, 4, bias=False), torch.nn.Linear(16, 6)
        self.o = torch.nn.Linear(18, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.cat([self.q(x), self.k(x), self.v(x)], -1))


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_fused_views_and_single_gemms_bit_for_bit(rows):
    torch.manual_seed(0)
    block = _Siblings()
    assert linears.install_onednn_linears(block) == 4
    packs = linears.Prepacked(block, True, release=False)
    x = torch.randn(1, rows, 16)
    with torch.inference_mode():
        with linears.onednn_scope(True, packs):
            block(x)  # the probe step
        assert packs.fused() == [(block.q, block.k, block.v)]
        fused, single = packs.gemms[0], packs.gemms[1]
        with linears.onednn_scope(True, packs):
            got = [packs.linear(m, x) for m in (block.q, block.k, block.v)]
            again = packs.linear(block.k, x)  # handed out once: the member's own call the second time
            other = packs.linear(block.k, x.clone())  # not the input the group ran on
            y = torch.randn(1, rows, 18)
            out = packs.linear(block.o, y)
        want = _reference_packed(x, fused.weight, fused.bias).split(fused.sizes, -1)
        assert again is None and other is None and packs._pending is None
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and torch.equal(g, w)
        assert torch.equal(out, _reference_packed(y, single.weight, single.bias))
        with linears.onednn_scope(True, packs):
            full = block(x)
        ref = block(x)  # outside the scope: F.linear
    assert torch.allclose(full, ref, atol=1e-5, rtol=1e-5)
