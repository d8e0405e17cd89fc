"""Loading by name (``flashpage.engine.loading``): the built-in model by its name everywhere
(``LLM("flashpage-tiny")`` as ``--model flashpage-tiny``), the checkpoint's dtype unless told
otherwise, CUDA by default when torch sees a GPU, and one set of messages for bad names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.engine import loading
from flashpage.tiny import load_tiny_model


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = load_tiny_model(torch.bfloat16)
    path = tmp_path_factory.mktemp("bf16")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_llm_takes_the_builtin_model_by_name() -> None:
    model, tok = load_tiny_model()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    by_name = LLM("flashpage-tiny", max_num_seqs=2, num_blocks=16).generate(["The list"], params, use_tqdm=False)
    by_object = LLM(model, tok, max_num_seqs=2, num_blocks=16).generate(["The list"], params, use_tqdm=False)
    assert by_name[0].outputs[0].token_ids == by_object[0].outputs[0].token_ids
    assert len(by_name[0].outputs[0].token_ids) == 8


def test_the_builtin_model_loads_in_float32_unless_told(bf16_checkpoint: Path) -> None:
    model, tok = loading.load_model(None)
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert tok.pad_token_id is not None
    model, _ = loading.load_model("flashpage-tiny", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_a_checkpoint_loads_in_its_own_dtype_unless_told(bf16_checkpoint: Path) -> None:
    model, _ = loading.load_model(str(bf16_checkpoint))
    assert next(model.parameters()).dtype == torch.bfloat16
    model, _ = loading.load_model(str(bf16_checkpoint), dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    llm = LLM(str(bf16_checkpoint), num_blocks=8, max_num_seqs=1)
    assert next(llm.model.parameters()).dtype == torch.bfloat16


def test_the_default_device_is_cuda_when_torch_sees_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert loading.default_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loading.default_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loading.default_device() == torch.device("cpu")


def test_bad_names_are_refused_before_loading(bf16_checkpoint: Path) -> None:
    config = bf16_checkpoint / "config.json"
    with pytest.raises(loading.ModelPathError, match=r"--model .*config\.json: that is a file, not a model") as err:
        loading.load_model(str(config), label=f"--model {config}")
    assert isinstance(err.value, ValueError) and isinstance(err.value, OSError)
    with pytest.raises(ValueError, match=r"LLM\('./nowhere'\): no such directory.*'flashpage-tiny'"):
        LLM("./nowhere")
    with pytest.raises(ValueError, match="dtype='float33' is not a torch dtype"):
        loading.load_model(None, dtype="float33")
    assert loading.as_dtype("auto") is None and loading.as_dtype("torch.float16") is torch.float16
