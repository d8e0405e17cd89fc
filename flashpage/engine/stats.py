"""``EngineStats``: a snapshot of an engine's pool, queues and counters (:meth:`flashpage.LLM.stats`).

Its own module so that processes which only read stats (the HTTP front of ``flashpage serve``,
whose engine runs in another process) need not import the engine and transformers' modeling code.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashpage.cache import KVGroup


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (see :meth:`LLM.stats`)."""

    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    block_size: int
    prefix_cache_hit_rate: float
    preemptions: int
    steps: int
    tokens_computed: int
    generated_tokens: int
    busy_seconds: float
    compiled_steps: int = 0  # steps that ran through the compiled forward (LLM(compile=True))
    tp_rank: int = 0  # tensor parallel: this process's rank and the group size (1: no TP)
    tp_size: int = 1
    kv_heads: int = 0  # KV heads in this rank's pool (under TP: its local heads only)
    kv_bytes: int = 0  # this rank's KV pool (K and V, all layers)
    kv_groups: tuple[KVGroup, ...] = ()  # the page pools, one per K/V geometry (Gemma 4: sliding and global layers)
    prefix_caching: bool = True  # off for models with recurrent layers (their states are not snapshotted per block)
    kv_bytes_per_token: int = 0  # K+V bytes one token of a sequence takes in the pool (all paged layers)
    state_bytes_per_seq: int = 0  # recurrent / linear-attention state bytes per sequence (hybrid models)
    state_bytes: int = 0  # the state slots allocated (all sequences)
    flat_steps: int = 0  # eager steps that ran as the flat loop (engine/flat.py; LLM.flat_step says why not)
    spec_proposed_tokens: int = 0  # speculative decoding: proposed tokens verified
    spec_accepted_tokens: int = 0  # ... of which accepted
    spec_verifications: int = 0  # ... verified proposals (one per sequence and step)
    spec_mean_acceptance_length: float = 0.0  # tokens per verified sequence-step (1 + accepted on average)

    @property
    def output_tokens_per_second(self) -> float:
        return self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0
