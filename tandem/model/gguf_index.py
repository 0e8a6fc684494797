"""A GGUF file's tensor table (name, GGML type, shape, where its bytes lie), read once.

``gguf.GGUFReader`` parses every metadata field, the tokenizer's ~100k strings among them,
one small numpy view at a time: about 3 s for the default model's file, which each worker
start paid twice (the quantization check and the int4 load). The table is all the loaders
need, so it is kept as JSON beside the converted model (gguf_cache.py) and read from there
by every later process; the bytes themselves are mapped from the file on demand.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from tandem.model.gguf_cache import cache_root

logger = logging.getLogger(__name__)

INDEX_VERSION = 1
"""Bumped when the JSON's layout changes (older files are then read again from the GGUF)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str
    """Its GGML type's name, e.g. "Q4_1", "Q8_0", "F32"."""
    shape: tuple[int, ...]
    """As GGUF lists it: the fastest-varying dimension first."""
    offset: int
    """The byte offset of its data from the start of the file."""
    num_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    path: str
    architecture: str
    """``general.architecture``, e.g. "llama"."""
    tensors: dict[str, GGUFTensor]

    def types(self) -> dict[str, str]:
        """Tensor name -> its GGML type's name."""
        return {name: t.type_name for name, t in self.tensors.items()}

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes: [num_bytes] uint8, mapped read-only from the file."""
        t = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.num_bytes,))


def _key(path: str) -> str:
    stat = os.stat(path)
    version = importlib.metadata.version("gguf")  # (without importing it: that is most of its cost)
    return hashlib.blake2b(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{version}|{INDEX_VERSION}".encode(),
                           digest_size=8).hexdigest()


def _read(path: str) -> GGUFIndex:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    tensors = {t.name: GGUFTensor(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape), int(t.data_offset),
                                  int(t.n_bytes)) for t in reader.tensors}
    return GGUFIndex(path, architecture, tensors)


def _stored(index: GGUFIndex, file: str) -> None:
    """Write the index for the next process (best effort; concurrent writers are fine)."""
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        body = {"architecture": index.architecture,
                "tensors": [dataclasses.astuple(t) for t in index.tensors.values()]}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), prefix=".index-")
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, file)  # atomic: a reader sees the whole file or none
    except OSError as e:
        logger.warning("could not keep the GGUF index at %s: %s", file, e)


@functools.lru_cache(maxsize=8)
def gguf_index(path: str) -> GGUFIndex:
    """The tensor table of the GGUF file at ``path``: from the cache when the file is unchanged,
    else read from the file (and kept for next time)."""
    root = cache_root()
    file = None if root is None else os.path.join(root, "gguf-index", f"{os.path.basename(path)}-{_key(path)}.json")
    if file is not None and os.path.isfile(file):
        with open(file) as f:
            body = json.load(f)
        tensors = {t[0]: GGUFTensor(t[0], t[1], tuple(t[2]), t[3], t[4]) for t in body["tensors"]}
        return GGUFIndex(path, body["architecture"], tensors)
    index = _read(path)
    if file is not None:
        _stored(index, file)
    return index
