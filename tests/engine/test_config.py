"""EngineConfig: LLM's options typed and checked once, before any model loads, and carried whole by
``flashpage serve`` (thread or engine process) and tensor-parallel ranks."""

from __future__ import annotations

import pickle

import pytest

from flashpage import LLM
from flashpage.engine import loading
from flashpage.engine.config import EngineConfig
from flashpage.serve.engine_process import EngineSpec
from flashpage.serve.server import ServeOptions


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded although an option was bad")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr("flashpage.engine.llm.load_model", refuse)


@pytest.mark.parametrize(("options", "message"), [
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive int, got 0"),
    ({"block_size": -16}, "block_size must be a positive int"),
    ({"cpu_prepack": "yes"}, "cpu_prepack='yes'"),
    ({"generation_config": "hf"}, "generation_config='hf'"),
    ({"dtype": "float33"}, "not a torch dtype"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
])
def test_bad_options_fail_before_the_model_loads(no_loading: None, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
    with pytest.raises(ValueError, match=message):
        LLM("flashpage-tiny", **options)


def test_unknown_option_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['max_seqs'\]"):
        EngineConfig.from_options({"max_seqs": 4})


def test_none_means_not_given_and_the_config_travels_whole() -> None:
    config = EngineConfig.from_options({"max_num_seqs": 4, "block_size": None, "dtype": "bfloat16"})
    assert config.max_num_seqs == 4 and config.block_size is None and config.max_num_batched_tokens == 2048
    assert config.llm_kwargs(drop=("dtype", "device"))["max_num_seqs"] == 4
    assert "dtype" not in config.llm_kwargs(drop=("dtype", "device"))
    spec = EngineSpec(engine={"max_num_seqs": 4, "num_blocks": 32})  # a mapping is checked into a config
    assert isinstance(spec.engine, EngineConfig) and pickle.loads(pickle.dumps(spec)).engine == spec.engine
    assert ServeOptions(engine={"num_blocks": 8}).engine == EngineConfig(num_blocks=8)


def test_llm_keeps_its_config() -> None:
    llm = LLM("flashpage-tiny", max_num_seqs=3, num_blocks=32, generation_config="vllm")
    assert llm.config.max_num_seqs == 3 and llm.config.num_blocks == 32
    assert llm.config.generation_config == "vllm"
    again = LLM(llm.model, llm.tokenizer, **llm.config.llm_kwargs(drop=("dtype", "device")))
    assert again.config == llm.config.replace(dtype=None, device=None)
