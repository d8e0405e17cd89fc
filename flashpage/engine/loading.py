"""Loading a model by name: the one place ``LLM(path)``, ``flashpage serve / generate / demo``, the
benches and tensor-parallel ranks turn a name into ``(model, tokenizer)``.

A name is ``"flashpage-tiny"`` (or ``None``: the built-in model, from the package, never the hub), a
local checkpoint directory, or a hub id. Defaults follow vLLM's: the checkpoint's own dtype
(``dtype=None`` is transformers' ``"auto"``) and CUDA when torch sees a GPU, else the CPU. Bad names,
dtypes and devices are refused here, before anything loads, with one set of messages; ``label`` says
how the caller spelled the name (``"LLM('x')"``, ``"--model x"``) so the message points at it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TINY_MODEL_NAME = "flashpage-tiny"  # the built-in model's name (what `flashpage serve` calls it)


class ModelPathError(OSError, ValueError):
    """A model name that cannot be a checkpoint (a file, a missing local directory). An ``OSError``
    like transformers' own loading errors and a ``ValueError`` like LLM's other argument errors."""


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.float16"``); ``None`` for
    ``None`` / ``"auto"`` (the checkpoint's own dtype)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return None
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype: give e.g. 'float32', 'float16' or 'bfloat16' "
                         "(or 'auto': the checkpoint's own)")
    return value


def as_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device torch knows: give e.g. 'cpu', 'cuda' or 'cuda:1' "
                         f"({exc})") from None


def check_device(device: str | torch.device | None) -> None:
    """A CUDA device on a torch without CUDA (or without a visible GPU): say so before loading anything."""
    if device is None:
        return
    want = as_device(device)
    if want.type == "cuda" and not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no GPU is visible (CUDA_VISIBLE_DEVICES?)"
        raise ValueError(f"device={str(device)!r}, but CUDA is not available: torch {torch.__version__} is {why}. "
                         "Install a CUDA build of torch (https://pytorch.org/get-started/locally/) or use "
                         "device='cpu'")
    if want.type == "cuda" and want.index is not None and want.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}, but this machine has {torch.cuda.device_count()} CUDA "
                         "device(s)")


def default_device() -> torch.device:
    """Where a model loaded by name goes when no device is given: CUDA if torch sees a GPU (vLLM's
    default), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def is_tiny(name: str | os.PathLike | None) -> bool:
    return name is None or (isinstance(name, str) and name == TINY_MODEL_NAME)


def check_model_path(name: str | os.PathLike, label: str) -> None:
    """Refuse a name that is a file, or looks local (``./``, ``/``, ``~``, a ``PathLike``) but is no
    directory: transformers would try the hub with it and fail obscurely."""
    local = Path(os.path.expanduser(os.fspath(name)))
    if local.is_file():
        raise ModelPathError(f"{label}: that is a file, not a model; give the checkpoint directory that holds "
                             f"config.json and the weights (e.g. {str(local.parent)!r}) or a hub id")
    looks_local = isinstance(name, os.PathLike) or os.fspath(name).startswith((".", "/", "~"))
    if looks_local and not local.is_dir():
        raise ModelPathError(f"{label}: no such directory; give a local checkpoint directory, a hub id, or "
                             f"{TINY_MODEL_NAME!r} for the built-in model")


def load_model(name: str | os.PathLike | None, *, dtype: torch.dtype | str | None = None,
               device: str | torch.device | None = None, tensor_parallel_size: int | None = None,
               tokenizer: Any = None, label: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)``, the model in eval mode on ``device`` (default :func:`default_device`).

    Args:
        name: ``None`` / ``"flashpage-tiny"`` (the built-in model), a checkpoint directory or a hub id.
        dtype: a dtype or its name; ``None`` / ``"auto"``: the checkpoint's (the built-in model's is
            float32).
        device: e.g. ``"cpu"``, ``"cuda:1"``; refused with tensor parallelism (each rank picks its own).
        tensor_parallel_size: > 1 loads this rank's shard under ``torchrun`` (``tp_plan="auto"``).
        tokenizer: used as given when not None; else loaded from the same place.
        label: how the caller named the model, for messages (default ``repr(name)``).
    """
    label = label or repr(os.fspath(name) if name is not None else TINY_MODEL_NAME)
    want_dtype = as_dtype(dtype)
    check_device(device)
    if is_tiny(name) and tensor_parallel_size not in (None, 1):
        from flashpage.tiny import tiny_model_path

        name = tiny_model_path()  # sharded like any checkpoint
    if is_tiny(name):
        from flashpage.tiny import load_tiny_model

        model, tiny_tokenizer = load_tiny_model(want_dtype)
        tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer
    else:
        check_model_path(name, label)
        model = _from_pretrained(name, want_dtype, tensor_parallel_size, device)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(name)
    if tensor_parallel_size is None or tensor_parallel_size == 1:
        model = model.to(as_device(device) if device is not None else default_device())
    if tokenizer is not None and getattr(tokenizer, "pad_token_id", 0) is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def load_processor(name: str | os.PathLike | None, model: Any) -> Any:
    """A vision-language checkpoint's processor (``AutoProcessor``) for ``model`` loaded from ``name``; None for
    the built-in model, a model that takes no images, or a checkpoint without a (buildable) processor."""
    if is_tiny(name):
        return None
    from flashpage.engine.multimodal import load_processor as load

    return load(os.fspath(name), model)


def _from_pretrained(name: str | os.PathLike, dtype: torch.dtype | None, tensor_parallel_size: int | None,
                     device: str | torch.device | None) -> Any:
    if tensor_parallel_size is not None and tensor_parallel_size != 1:
        from flashpage.engine.distributed import load_tp_model

        return load_tp_model(name, dtype or "auto", tensor_parallel_size, device)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(AutoConfig.from_pretrained(name), "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        # a vision-language checkpoint (LLaVA...): its image-text-to-text class (images in LLM: engine/multimodal.py)
        return AutoModelForImageTextToText.from_pretrained(name, dtype=dtype or "auto")
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype or "auto")
