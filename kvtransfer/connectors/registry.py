"""The KV connectors by name: torch-free, so the router offers `--kv-transport`'s choices and
the metrics their path labels without loading torch.

Each entry names the module and class that implement it (loaded on first use). The order
is the receiver's: a HELLO is answered by the first connector it asks for that agrees, and
by FALLBACK (frames, which every pair can take) when none does.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.kvtransfer.connectors.base import KVConnector


@dataclass(frozen=True)
class ConnectorEntry:
    """One registered data path."""

    name: str
    """What path_choice names it, and `--kv-transport` when it is selectable."""
    module: str
    class_name: str
    selectable: bool
    """An operator may ask for it (`--kv-transport NAME`); else `auto` alone takes it."""
    label: str
    """Its `path` label in tandem_kv_transfer_paths_total (two pair backends share "dist")."""


CONNECTORS: dict[str, ConnectorEntry] = {}
FALLBACK = "zmq"


def register_connector(name: str, module: str, class_name: str, selectable: bool, label: str = "") -> None:
    """Add a connector (ValueError for a name taken)."""
    if name in CONNECTORS or name == "auto":
        raise ValueError(f"a KV connector named {name!r} is registered already")
    CONNECTORS[name] = ConnectorEntry(name, module, class_name, selectable, label or name)


def load_connector(name: str) -> type[KVConnector]:
    """The class of connector `name` (KeyError for one not registered)."""
    entry = CONNECTORS[name]
    cls: type[KVConnector] = getattr(importlib.import_module(entry.module), entry.class_name)
    return cls


def kv_transports() -> tuple[str, ...]:
    """`--kv-transport`'s choices: auto (the best path each pair allows), then every selectable connector."""
    return ("auto", *(e.name for e in CONNECTORS.values() if e.selectable))


def answer_order() -> list[str]:
    """The connectors in the order a receiver asks them to answer a HELLO: FALLBACK last."""
    return [*(name for name in CONNECTORS if name != FALLBACK), FALLBACK]


def path_labels() -> tuple[str, ...]:
    """The data paths' metric labels, once each."""
    return tuple(dict.fromkeys(e.label for e in CONNECTORS.values()))


_HERE = "tandem.kvtransfer.connectors"
register_connector("nccl", f"{_HERE}.dist_pair", "DistPairConnector", selectable=True, label="dist")
register_connector("gloo", f"{_HERE}.dist_pair", "DistPairConnector", selectable=True, label="dist")
register_connector("cuda_ipc", f"{_HERE}.cuda_ipc_in_place", "CudaIpcConnector", selectable=False)
register_connector("shm", f"{_HERE}.shm_in_place", "SharedMemoryConnector", selectable=False)
register_connector("zmq", f"{_HERE}.zmq_frames", "ZmqFramesConnector", selectable=True)
