"""What a worker (prefill, decode or colocated) is built with: frozen, made once by whoever
starts the workers (``tandem serve``, the benchmarks, tests) and pickled by Ray to every
worker actor. The values that depend on where a worker runs (its threads, its device, its
pool's tensor-parallel size, its node) are set on a copy before it is sent
(``dataclasses.replace``, :meth:`WorkerConfig.with_engine`), never by changing one.
Torch-free, beneath everything else: the router builds it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.config.engine_options import ENGINE_DEFAULTS, EngineOptions
from tandem.config.kv_transfer_config import KVTransferConfig

OWN_FIELDS = ("device", "dtype")
"""Engine options that are WorkerConfig's own fields (the worker resolves them in its process)."""


@dataclass(frozen=True)
class WorkerConfig:
    """One worker's model, engine and KV transfer settings (every worker of a cluster gets the same)."""

    model: str | None = None
    """A local HF directory, a .gguf file or a hub id; None: the embedded default model."""
    revision: str | None = None
    """A hub model's branch, tag or commit (None: main)."""
    device: str = ENGINE_DEFAULTS["device"]
    """The engine's device: auto, cpu, cuda or cuda:N (auto is resolved in the worker's
    process, which sees the GPUs Ray gave it)."""
    dtype: str = ENGINE_DEFAULTS["dtype"]
    """Weights and KV cache (auto: chosen for the device, in the worker's process)."""
    num_threads: int | None = None
    """torch threads of the worker's process, pinned so that workers sharing a host do not
    fight (None: torch's default; start_cluster sets the host's cores / ranks)."""
    generation_config: str = "auto"
    """Where requests' sampling defaults come from (model.generation_defaults: auto, vllm, or a directory)."""
    fault_injection: bool = False
    """The worker's ``inject_fault`` may break its engine (fault tests only)."""
    engine: EngineOptions = EngineOptions()
    """Every other engine option given (EngineConfig.build's keywords; the rest at their
    defaults), tensor_parallel_size included: each pool's, set by start_cluster."""
    kv_transfer: KVTransferConfig = KVTransferConfig()
    """How prefill and decode workers move KV between them."""
    publish_kv_events: bool = False
    """Publish the KV pool's (and its tiers') block events for the router's precise prefix
    index (--policy precise_prefix; tandem/worker/kv_events_publisher.py)."""

    def __post_init__(self) -> None:
        given_twice = [name for name in OWN_FIELDS if name in self.engine]
        if given_twice:
            raise ValueError(f"{', '.join(given_twice)}: a WorkerConfig field, not an engine option")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    @classmethod
    def build(cls, *, kv_transfer: KVTransferConfig = KVTransferConfig(), **settings: Any) -> WorkerConfig:
        """A WorkerConfig from keywords: its fields by name, and any engine option (``build(model=m,
        num_threads=1, kv_cache_memory_gib=0.1)``); ValueError for a keyword that is neither."""
        own = {f.name for f in dataclasses.fields(cls)} - {"engine", "kv_transfer"}
        engine = EngineOptions.of({k: v for k, v in settings.items() if k not in own})
        return cls(**{k: v for k, v in settings.items() if k in own}, engine=engine, kv_transfer=kv_transfer)

    def with_engine(self, **changes: Any) -> WorkerConfig:
        """This config with the engine options ``changes`` given too, over any given before."""
        return dataclasses.replace(self, engine=self.engine.replace(**changes))

    def engine_args(self, device: str, dtype: str) -> dict[str, Any]:
        """EngineConfig.build's keywords on ``device`` and ``dtype`` (this config's, resolved)."""
        return dict(self.engine, device=device, dtype=dtype)
