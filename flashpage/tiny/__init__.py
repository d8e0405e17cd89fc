"""flashpage's built-in tiny causal LM: a ~4M-parameter Llama that writes readable text offline.

The model lives in ``flashpage/tiny/model/`` (config, float16 safetensors, byte-level BPE tokenizer,
generation config and a model card). It was trained by :mod:`flashpage.tiny.train` on CPU in a few
minutes on text that ships with Python (pydoc help topics and standard-library docstrings, see
:mod:`flashpage.tiny.corpus`), so its output is documentation-flavoured word salad made of real
words. It is the default model of the CLI, the example notebooks and the tests.

Importing this package is cheap: torch and transformers are imported only by :func:`load_tiny_model`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["load_tiny_model", "tiny_model_path"]


def tiny_model_path() -> Path:
    """The folder holding the saved tiny model (``flashpage/tiny/model``)."""
    return Path(__file__).resolve().parent / "model"


def load_tiny_model(
    dtype: torch.dtype | str | None = None,
    device: Any = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the tiny model and its tokenizer from :func:`tiny_model_path`, model in eval mode.

    Args:
        dtype: parameter dtype, a ``torch.dtype`` or its name (``"float16"``); ``None`` means
            ``torch.float32`` (the weights are stored in float16 and upcast).
        device: optional device to move the model to (e.g. ``"cuda"``); default: CPU.

    Nothing is downloaded: both come from the local folder.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is None:
        dtype = torch.float32
    elif isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"not a torch dtype: {dtype!r}")
        dtype = resolved
    path = tiny_model_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"tiny model not found in {path}; rebuild it with `python -m flashpage.tiny.train`")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    if device is not None:
        model = model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
