"""The GGUF tensor table kept on disk: the same names, types, shapes and bytes as
gguf.GGUFReader reads from the file, read back from the cache by a later process, and read
again from the file once the file changes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from tandem.model import gguf_index as index_module
from tandem.model.gguf_cache import CACHE_ENV
from tandem.model.gguf_index import gguf_index
from tandem.model.gguf_q4 import gguf_path
from tandem.model.source import resolve_model_source


@pytest.fixture(scope="module")
def default_gguf() -> str:
    path = gguf_path(resolve_model_source(None))
    assert path is not None
    return path


def test_the_index_is_what_gguf_reads(default_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    gguf_index.cache_clear()
    try:
        index = gguf_index(default_gguf)
        (kept,) = list((tmp_path / "gguf-index").iterdir())
        gguf_index.cache_clear()
        assert gguf_index(default_gguf) == index  # read back from the JSON
    finally:
        gguf_index.cache_clear()
    reader = GGUFReader(default_gguf)
    assert index.architecture == "llama" and len(index.tensors) == len(reader.tensors) == 272
    for t in reader.tensors:
        ours = index.tensors[t.name]
        assert (ours.type_name, ours.shape, ours.num_bytes) == (t.tensor_type.name, tuple(t.shape), t.n_bytes)
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight", "output_norm.weight"):
        (t,) = [t for t in reader.tensors if t.name == name]
        assert np.array_equal(index.raw(name), np.asarray(t.data).reshape(-1).view(np.uint8)), name
    assert {index.tensors[n].type_name for n in ("blk.3.attn_k.weight", "token_embd.weight")} == {"Q4_1", "Q8_0"}
    assert kept.name.startswith(os.path.basename(default_gguf))


def test_a_changed_file_is_read_again_and_a_later_process_reads_the_cache(default_gguf, tmp_path, monkeypatch):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_gguf, copy)
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    reads: list[str] = []
    real_read = index_module._read

    def counted_read(path: str) -> index_module.GGUFIndex:
        reads.append(path)
        return real_read(path)

    monkeypatch.setattr(index_module, "_read", counted_read)
    gguf_index.cache_clear()
    try:
        first = gguf_index(str(copy))
        # Another process, with the cache left: no GGUFReader at all.
        probe = ("import sys; from tandem.model.gguf_index import gguf_index; i = gguf_index(sys.argv[1]); "
                 "assert 'gguf' not in sys.modules; print(i.tensors['blk.0.attn_q.weight'].type_name)")
        out = subprocess.run([sys.executable, "-c", probe, str(copy)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, CACHE_ENV: str(cache)})
        assert out.returncode == 0 and out.stdout.strip() == "Q4_1", out.stderr[-2000:]
        os.utime(copy, ns=(0, 0))  # the file changed (as far as anyone can tell without reading it)
        gguf_index.cache_clear()
        assert gguf_index(str(copy)) == first
        assert reads == [str(copy), str(copy)]
        assert len(list((cache / "gguf-index").iterdir())) == 2
    finally:
        gguf_index.cache_clear()
