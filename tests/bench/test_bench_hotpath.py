"""`flashpage bench hotpath`'s token check: identical, a difference at a reference tie, or a real difference."""

from __future__ import annotations

import torch

from flashpage.bench import hotpath


def test_agreement_names_a_difference_that_is_not_a_tie():
    model = hotpath.hotpath_model(0)
    inputs = hotpath._batch(2, seed=2)
    ref = hotpath._gen(model, inputs, 6)
    assert hotpath._agreement(model, inputs, 6, ref, ref.clone()) == (True, "")
    changed = ref.clone()
    changed[1, -3] = (changed[1, -3] + 1) % hotpath.VOCAB
    agree, detail = hotpath._agreement(model, inputs, 6, ref, changed)
    assert not agree and detail.startswith("row 1: first difference at new token 3") and "NOT a tie" in detail
    assert torch.equal(ref, hotpath._gen(model, inputs, 6))  # the check's extra run leaves the model as it was
