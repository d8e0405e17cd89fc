"""EngineConfig: every ``flashpage.LLM`` option besides the model and tokenizer, typed and checked once.

``LLM(model, **options)`` builds one (``LLM.config``); ``flashpage serve`` builds one from its command line
before any model loads (a bad option fails at once, not after a minute of loading) and carries it whole to
the engine process and to tensor-parallel ranks: ``LLM(model, tokenizer, **config.llm_kwargs())``.
Checks that need the model (pool sizing, TP sharding, what a draft model can run) stay in ``LLM``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flashpage.engine.generation_config import check_mode as check_generation_mode
from flashpage.engine.linears import check_prepack_mode
from flashpage.engine.loading import as_dtype, check_device
from flashpage.engine.sizing import check_utilization
from flashpage.engine.spec import SpeculativeConfig
from flashpage.errors import check_positive_ints

# options that may be None, meaning "the default" (the rest must be positive ints when given)
_OPTIONAL_INTS = ("block_size", "num_blocks", "max_model_len", "max_prefill_with_decodes")


@dataclass(frozen=True)
class EngineConfig:
    """``LLM``'s keyword options (see :class:`flashpage.LLM` for each); checked on construction."""

    block_size: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    dtype: torch.dtype | str | None = None
    device: str | torch.device | None = None
    check_invariants: bool = False
    compile: bool | None = None
    max_prefill_with_decodes: int | None = None
    tensor_parallel_size: int | None = None
    generation_config: str = "auto"
    cpu_prepack: bool | str = "auto"
    speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        check_device(self.device)
        as_dtype(self.dtype)
        check_positive_ints("LLM: ", {"max_num_seqs": self.max_num_seqs,
                                      "max_num_batched_tokens": self.max_num_batched_tokens,
                                      **{k: getattr(self, k) for k in _OPTIONAL_INTS if getattr(self, k) is not None}})
        check_utilization(self.gpu_memory_utilization)
        object.__setattr__(self, "generation_config", check_generation_mode(self.generation_config))
        object.__setattr__(self, "cpu_prepack", check_prepack_mode(self.cpu_prepack))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> EngineConfig:
        """From keyword options where None means "not given" (a command line's); unknown names are refused."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}: LLM takes {sorted(names)}")
        return cls(**{k: v for k, v in options.items() if v is not None})

    def llm_kwargs(self, *, drop: tuple[str, ...] = ()) -> dict[str, Any]:
        """The options as ``LLM`` keyword arguments (``drop``: names the caller decides itself)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in drop}

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
