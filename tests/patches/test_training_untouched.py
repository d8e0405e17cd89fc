"""Training is untouched by the patch: a patched model's training forward (no cache) gives exactly
the unpatched loss and gradients, in every supported family.

Same weights, same seed, same batch (left padding and all): train mode with every dropout of the
config at 0.1, gradient checkpointing on; and eval mode without it. Exact equality, not a tolerance:
RL trainers train the very model flashpage generates with (see flashpage.integrations.trl).
"""

from __future__ import annotations

import pytest
import torch
from model_zoo import FAMILIES, config_kwargs, left_padded_batch, model_from_config, tiny_config, torch_threads

from flashpage import patch, unpatch
from flashpage.patches import ATTN_NAME
from flashpage.patches.patching import patch_state

DROPOUT = 0.1


def _with_dropout(model_type: str) -> torch.nn.Module:
    """The zoo model with every dropout probability its config has set to DROPOUT."""
    config = tiny_config(model_type)
    names = [k for k, v in config.to_dict().items()
             if isinstance(v, float) and ("dropout" in k or "pdrop" in k) and k != "classifier_dropout"]
    return model_from_config(model_type, tiny_config(model_type, **{k: DROPOUT for k in names},
                                                     **config_kwargs(model_type)))


def _loss_and_grads(model: torch.nn.Module, train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, mask = left_padded_batch([9, 6, 12], seed=5)
    labels = ids.masked_fill(mask == 0, -100)
    model.zero_grad(set_to_none=True)
    model.train(train)
    torch.manual_seed(1234)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_identical(a: tuple, b: tuple, what: str) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b), f"{what}: loss {loss_a.item()!r} unpatched vs {loss_b.item()!r} patched"
    assert grads_a.keys() == grads_b.keys(), f"{what}: different parameters got gradients"
    for name, g in grads_a.items():
        diff = (g - grads_b[name]).abs().max().item()
        assert torch.equal(g, grads_b[name]), f"{what}: gradient of {name} differs by up to {diff:.3g}"


def _checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Gradient (activation) checkpointing on or off, by whichever name this transformers uses."""
    new = "activation_checkpointing_enable" if on else "activation_checkpointing_disable"
    old = "gradient_checkpointing_enable" if on else "gradient_checkpointing_disable"
    getattr(model, new if hasattr(model, new) else old)()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_patched_training_forward_is_the_unpatched_one(model_type):
    with torch_threads(1):
        model = _with_dropout(model_type)
        _checkpointing(model, True)
        ref_train = _loss_and_grads(model, train=True)
        _checkpointing(model, False)
        ref_eval = _loss_and_grads(model, train=False)
        patch(model)
        try:
            if patch_state(model).family.set_attention:  # the forward below really goes through flashpage's
                assert model.config._attn_implementation == ATTN_NAME
            _checkpointing(model, True)
            _assert_identical(ref_train, _loss_and_grads(model, train=True), f"{model_type} train+dropout+ckpt")
            _checkpointing(model, False)
            _assert_identical(ref_eval, _loss_and_grads(model, train=False), f"{model_type} eval")
        finally:
            unpatch(model)
    assert ref_train[0].isfinite() and ref_train[1]
    assert not torch.equal(ref_train[0], ref_eval[0])  # dropout was on in train mode: the comparison saw it
