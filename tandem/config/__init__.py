"""Configuration, torch-free and beneath everything else in tandem: the names flags are
checked against (names.py), each engine option defined once (engine_options.py), a model's
shape (model_config.py), what an engine runs with (engine_config.py), what a worker is built
with (worker_config.py, kv_transfer_config.py), and where options come from (option_sources.py,
model_args.py, device.py).

The configs are frozen once built: every derived value is worked out before construction.
"""

from tandem.config.engine_config import EngineConfig
from tandem.config.engine_options import EngineOptions
from tandem.config.kv_transfer_config import KVTransferConfig
from tandem.config.model_config import (
    ARCHITECTURE_OF_MODEL_TYPE,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    check_architecture,
    gib_to_bytes,
    kv_bytes_per_token,
    kv_heads_per_rank,
)
from tandem.config.worker_config import WorkerConfig

__all__ = ["ARCHITECTURE_OF_MODEL_TYPE", "SUPPORTED_ARCHITECTURES", "EngineConfig", "EngineOptions",
           "KVTransferConfig", "ModelConfig", "WorkerConfig", "check_architecture", "gib_to_bytes",
           "kv_bytes_per_token", "kv_heads_per_rank"]
