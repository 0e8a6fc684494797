"""The clusters of the compatibility matrix (test_compatibility_matrix.py): the settings each
feature runs under, one cluster per setting and transport, and the Matrix that starts them one
at a time, keeps the colocated references' outputs and records every cell's result."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compat_matrix import (
    DEFAULT_RESULTS,
    DOC_ENV,
    RESULTS_ENV,
    cell_id,
    render,
    runnable_cells,
)
from compat_requests import Outcome
from running_cluster import RunningCluster, SameWorkers, running_clusters

from tandem.config import KVTransferConfig, WorkerConfig
from tandem.router.cluster import ClusterConfig
from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend

FLOAT_ENGINE: dict[str, Any] = dict(kv_cache_memory_gib=0.1, max_num_batched_tokens=256, quantization="none")
"""The session clusters' engine options (conftest.py): the colocated reference of the float rows."""
INT8_ENGINE: dict[str, Any] = dict(quantization="int8", num_speculative_tokens=4, max_num_batched_tokens=32,
                                   block_size=16)
INT4_ENGINE: dict[str, Any] = dict(quantization="int4", max_num_batched_tokens=32, block_size=16)
SMALL_POOL = 5
"""Blocks (16 tokens) of each worker's pool in the int8 and int4 clusters: one request of the
preemption batch fits at its full length, two do not."""


def cluster_config(prefix: str, *, transport: str = "auto", num_decode: int = 1, colocated: int = 0,
                   prefill_tp: int = 1, decode_tp: int = 1, **engine: Any) -> ClusterConfig:
    """A cluster of the matrix: its workers on one thread each, half a CPU a rank."""
    worker = WorkerConfig.build(num_threads=1, kv_transfer=KVTransferConfig(transport=transport), **engine)
    if colocated:
        return ClusterConfig(colocated=colocated, worker=worker, name_prefix=prefix, num_cpus_per_rank=0.5)
    return ClusterConfig(num_prefill=1, num_decode=num_decode, prefill_tp=prefill_tp, decode_tp=decode_tp,
                         disagg_policy="always", worker=worker, name_prefix=prefix, num_cpus_per_rank=0.5)


@dataclass(frozen=True)
class Setting:
    """Engine options a group of clusters shares (one per transport), with its colocated reference."""

    name: str
    engine: dict[str, Any]
    """Options of the disaggregated workers."""
    reference_engine: dict[str, Any] | None
    """Options of the colocated reference (None: the session's colocated cluster)."""
    prefill_tp: int = 1
    decode_tp: int = 1
    decode_tp_transports: tuple[str, ...] = ("shm", "zmq", "gloo")
    """The transports whose cluster runs the decode worker at decode_tp (the others at 1)."""
    num_decode: int = 1
    what: str = ""


SETTINGS = {
    "float": Setting("float", FLOAT_ENGINE, None, num_decode=2,
                     what="float32, 1 prefill + 2 decode workers; on shm the session's disaggregated cluster "
                          "(KV checksums on) and its local router; reference: the session's colocated worker"),
    "int8": Setting("int8", {**INT8_ENGINE, "num_kv_blocks": SMALL_POOL, "preemption_mode": "swap"},
                    {**INT8_ENGINE, "kv_cache_memory_gib": 0.1}, prefill_tp=2,
                    what=f"int8 weights, a prefill worker at tp=2 + a decode worker at tp=1, "
                         f"num_speculative_tokens 4, {SMALL_POOL}-block pools, preemption_mode swap, a 32-token "
                         f"step budget (chunked prefill); reference: a colocated worker with int8 weights, "
                         f"speculation and a roomy pool"),
    "int4": Setting("int4", {**INT4_ENGINE, "num_kv_blocks": SMALL_POOL, "preemption_mode": "recompute"},
                    {**INT4_ENGINE, "kv_cache_memory_gib": 0.1}, decode_tp=2, decode_tp_transports=("zmq", "gloo"),
                    what=f"int4 weights, a prefill worker at tp=1 + a decode worker at tp=2 (tp=1 on shm: auto "
                         f"writes in place only into a tp=1 pool), {SMALL_POOL}-block "
                         f"pools, preemption_mode recompute, a 32-token step budget; reference: a colocated "
                         f"worker with int4 weights and a roomy pool"),
}
FEATURE_SETTING = {
    **{f: "float" for f in ("greedy", "seeded", "n", "beam", "structured", "logprobs", "prefix_decode",
                            "prefix_prefill", "float")},
    **{f: "int8" for f in ("spec", "swap", "int8", "tp_prefill")},
    **{f: "int4" for f in ("recompute", "int4", "tp_decode")},
}
TRANSPORTS = ("shm", "zmq", "gloo")
PATH_OF = {"shm": "shm", "zmq": "zmq", "gloo": "dist"}
"""The column's KV path as tandem_kv_transfer_paths_total names it."""
KV_TRANSPORT = {"shm": "auto", "zmq": "zmq", "gloo": "gloo"}


def deployment_of(feature: str, column: str) -> str:
    """The cluster a cell runs on: its setting's, over its transport (local: shm's workers)."""
    return f"{FEATURE_SETTING[feature]}-{'shm' if column == 'local' else column}"


DEPLOYMENTS = [f"{s}-{t}" for s in SETTINGS for t in TRANSPORTS]
class Matrix:
    """The clusters of the matrix (one disaggregated cluster and one reference at a time), the
    reference outputs (each computed once), and every cell's result."""

    def __init__(self, session: dict[str, RunningCluster]) -> None:
        self.session = session
        self.loop = session["colocated"].loop
        self._stacks: dict[str, tuple[str, contextlib.ExitStack, dict[str, RunningCluster]]] = {}
        self.expected: dict[tuple[str, str], list[Outcome]] = {}
        self.results: dict[str, dict[str, str]] = {}
        self._subsets: dict[tuple[int, tuple[int, ...], tuple[int, ...], str], RayBackend] = {}

    def _start(self, slot: str, name: str,
               configs: dict[str, ClusterConfig | SameWorkers]) -> dict[str, RunningCluster]:
        held = self._stacks.get(slot)
        if held is not None and held[0] == name:
            return held[2]
        self.stop(slot)
        stack = contextlib.ExitStack()
        running = stack.enter_context(running_clusters(configs, self.loop))
        self._stacks[slot] = (name, stack, running)
        return running

    def stop(self, slot: str) -> None:
        held = self._stacks.pop(slot, None)
        if held is not None:
            held[1].close()

    def close(self) -> None:
        for slot in list(self._stacks):
            self.stop(slot)

    def deployment(self, name: str) -> dict[str, RunningCluster]:
        """{"disaggregated": ..., "local": ...} of the cluster ``name`` (setting-transport)."""
        setting_name, transport = name.split("-")
        if name == "float-shm":
            return {"disaggregated": self.session["disaggregated"], "local": self.session["local"]}
        s = SETTINGS[setting_name]
        configs: dict[str, ClusterConfig | SameWorkers] = {"disaggregated": cluster_config(
            f"cm-{name}-", transport=KV_TRANSPORT[transport], num_decode=s.num_decode, prefill_tp=s.prefill_tp,
            decode_tp=s.decode_tp if transport in s.decode_tp_transports else 1, **s.engine)}
        if transport == "shm":
            configs["local"] = SameWorkers("disaggregated", disagg_policy="never")
        return self._start("disaggregated", name, configs)

    def reference(self, setting: str) -> RunningCluster:
        engine = SETTINGS[setting].reference_engine
        if engine is None:
            return self.session["colocated"]
        return self._start("reference", setting, {"colocated": cluster_config(f"cm-{setting}-c-", colocated=1,
                                                                              **engine)})["colocated"]

    def subset(self, cluster: RunningCluster, prefill: tuple[int, ...], decode: tuple[int, ...],
               disagg_policy: str) -> RayBackend:
        """A router over some of ``cluster``'s workers (by index in each pool), not polling."""
        key = (id(cluster.backend), prefill, decode, disagg_policy)
        if key not in self._subsets:
            b = cluster.backend

            async def build() -> RayBackend:
                backend = RayBackend([WorkerState(b.prefill[i].instance, b.prefill[i].handle) for i in prefill],
                                     [WorkerState(b.decode[i].instance, b.decode[i].handle) for i in decode], [],
                                     b.prefill_router.policy, b.tokenizer_spec, disagg_policy=disagg_policy)
                await backend.loads()
                return backend
            self._subsets[key] = cluster.run(build())
        return self._subsets[key]

    def record(self, feature: str, column: str, status: str, deployment: str, detail: str = "") -> None:
        self.results[cell_id(feature, column)] = dict(status=status, deployment=deployment, detail=detail)

    def write(self) -> None:
        if not self.results:
            return
        path = Path(os.environ.get(RESULTS_ENV, DEFAULT_RESULTS))
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a run of some cells (-k) updates those cells of the last run
            self.results = {**json.loads(path.read_text()).get("cells", {}), **self.results}
        deployments = {s: SETTINGS[s].what for s in SETTINGS}
        date = datetime.date.today().isoformat()
        run = dict(date=date, cells=self.results, deployments=deployments)
        path.write_text(json.dumps(run, indent=1, ensure_ascii=False))
        doc = os.environ.get(DOC_ENV)
        if doc and all(cell_id(*c) in self.results for c in runnable_cells()):
            Path(doc).write_text(render(self.results, date, deployments))

