"""What a worker is built with: frozen, typed, and the same after Ray pickles it to an actor."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from tandem.config import EngineOptions, KVTransferConfig, WorkerConfig
from tandem.config.kv_transfer_config import NODE_IP


def test_a_worker_config_crosses_to_an_actor_whole():
    worker = WorkerConfig.build(model="/m", num_threads=2, kv_cache_memory_gib=0.1, max_num_seqs=8,
                                kv_transfer=KVTransferConfig(transport="zmq", checksum=True))
    assert (worker.model, worker.num_threads) == ("/m", 2)
    assert worker.engine == {"kv_cache_memory_gib": 0.1, "max_num_seqs": 8}
    assert pickle.loads(pickle.dumps(worker)) == worker
    with pytest.raises(dataclasses.FrozenInstanceError):
        worker.num_threads = 1  # type: ignore[misc]
    assert worker.engine_args("cpu", "float32") == {"kv_cache_memory_gib": 0.1, "max_num_seqs": 8,
                                                     "device": "cpu", "dtype": "float32"}


def test_engine_options_are_checked_and_replaced_not_changed():
    with pytest.raises(ValueError, match="no such engine options: kv_cache_gib"):
        WorkerConfig.build(kv_cache_gib=1.0)
    with pytest.raises(ValueError, match="device: a WorkerConfig field"):
        WorkerConfig(engine=EngineOptions.of({"device": "cpu"}))
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        WorkerConfig(num_threads=0)
    worker = WorkerConfig.build(max_num_batched_tokens=256)
    wider = worker.with_engine(max_num_batched_tokens=512, tensor_parallel_size=2)
    assert worker.engine == {"max_num_batched_tokens": 256}
    assert wider.engine == {"max_num_batched_tokens": 512, "tensor_parallel_size": 2}
    # One order whatever the order given: equal options are equal configs.
    assert EngineOptions.of({"seed": 1, "block_size": 8}) == EngineOptions.of({"block_size": 8, "seed": 1})


def test_the_receiver_address_is_worked_out_on_the_workers_node():
    assert KVTransferConfig().on_node("n1", "10.0.0.7") == KVTransferConfig(node_id="n1")
    assert KVTransferConfig().receiver_address is None  # the receiver's default: loopback
    on_node = KVTransferConfig(receiver_host=NODE_IP).on_node("n1", "10.0.0.7")
    assert (on_node.node_id, on_node.receiver_address) == ("n1", "tcp://10.0.0.7:0")
    assert KVTransferConfig(receiver_host="0.0.0.0").on_node("n1", "10.0.0.7").receiver_address == "tcp://0.0.0.0:0"
    with pytest.raises(ValueError, match="known only on the worker's node"):
        _ = KVTransferConfig(receiver_host=NODE_IP).receiver_address
    with pytest.raises(ValueError, match="must be > 0"):
        KVTransferConfig(timeout_s=0)


def test_every_engine_option_is_a_keyword_of_engine_config_build():
    """What an EngineOptions may hold is exactly what EngineConfig.build takes (but the model,
    the device and dtype, which the worker resolves, and what the worker's role decides)."""
    import inspect

    from tandem.config import EngineConfig
    from tandem.config.engine_options import BUILD_ONLY_OPTIONS, ENGINE_DEFAULTS

    taken = set(inspect.signature(EngineConfig.build).parameters) - {"cls", "model", "device", "dtype",
                                                                     "reserve_whole_prompts"}
    allowed = (set(ENGINE_DEFAULTS) | set(BUILD_ONLY_OPTIONS)) - {"device", "dtype", "gpu_memory_utilization"}
    assert allowed == taken
    assert WorkerConfig.build(num_kv_blocks=8).engine["num_kv_blocks"] == 8
