"""The disk tier's files: a block's KV back bit for bit (from its file, or from its copy
while the write is queued), a flipped byte or a truncated file detected and dropped, the
capacity kept by dropping the least recently used, and pools of another layout apart."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tandem.kvcache.disk_tier import HEADER, DiskTier, layout_key, share_id_of

SHAPE = (3, 2, 10, 4, 2, 8)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]


def pool(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def h(i: int) -> bytes:
    return bytes([i]) * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_comes_back_bit_for_bit(tmp_path, dtype):
    kv = pool(dtype)
    tier = DiskTier(kv, str(tmp_path), 1 << 20, layout_key("m", dtype))
    original = kv[:, :, 3].clone()
    tier.offload(3, h(1))
    assert tier.holds(h(1)) and not tier.holds(h(2))
    tier.flush()
    assert os.path.getsize(tier.path_of(h(1))) == HEADER.size + original.numel() * original.element_size()
    kv[:, :, 3] = 0  # the block handed out and overwritten
    assert tier.load(h(1), 7) and torch.equal(kv[:, :, 7], original)
    c = tier.counters
    assert (c.num_offloaded_blocks, c.num_loaded_blocks, c.num_corrupt_blocks) == (1, 1, 0)
    assert not tier.load(h(2), 7)  # never stored
    tier.close()


def test_a_queued_write_loads_from_its_copy(tmp_path):
    kv = pool()
    tier = DiskTier(kv, str(tmp_path), 1 << 20, "k")
    tier._queue.put(None)  # the writer stops: the offload stays queued
    tier._writer.join()
    original = kv[:, :, 2].clone()
    tier.offload(2, h(5))
    kv[:, :, 2] = 0
    assert tier.holds(h(5)) and not os.path.exists(tier.path_of(h(5)))
    assert tier.load(h(5), 4) and torch.equal(kv[:, :, 4], original)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "another block's file"])
def test_a_damaged_file_is_dropped_never_loaded(tmp_path, damage):
    kv = pool()
    tier = DiskTier(kv, str(tmp_path), 1 << 20, "k")
    tier.offload(1, h(1))
    tier.offload(2, h(2))
    tier.flush()
    path = tier.path_of(h(1))
    data = bytearray(open(path, "rb").read())
    if damage == "flipped byte":
        data[HEADER.size + 1000] ^= 0x01
    elif damage == "truncated":
        data = data[:-4]
    else:
        data = bytearray(open(tier.path_of(h(2)), "rb").read())
    open(path, "wb").write(bytes(data))
    before = kv[:, :, 6].clone()
    assert not tier.load(h(1), 6)
    assert torch.equal(kv[:, :, 6], before) and not os.path.exists(path) and not tier.holds(h(1))
    assert tier.counters.num_corrupt_blocks == 1
    assert tier.load(h(2), 6)  # the other block is untouched
    tier.close()


def test_capacity_drops_the_least_recently_used(tmp_path):
    kv = pool()
    block_bytes = kv[:, :, 0].numel() * 4
    tier = DiskTier(kv, str(tmp_path), 3 * (block_bytes + HEADER.size), "k")
    assert tier.capacity_blocks == 3
    for i in range(3):
        tier.offload(i, h(i))
    tier.flush()
    assert tier.load(h(0), 9)  # 0 is used again: 1 is now the least recently used
    tier.offload(3, h(3))
    tier.flush()
    assert [tier.holds(h(i)) for i in range(4)] == [True, False, True, True]
    assert tier.counters.num_dropped_blocks == 1
    assert sorted(os.listdir(tier.directory)) == sorted([h(i).hex() + ".kv" for i in (0, 2, 3)] + ["share-id"])
    tier.close()


def test_layouts_keep_apart_and_share_within(tmp_path):
    kv = pool()
    writer = DiskTier(kv, str(tmp_path), 1 << 20, layout_key("model-a", "float32"))
    writer.offload(4, h(9))
    writer.flush()
    other_model = DiskTier(pool(seed=1), str(tmp_path), 1 << 20, layout_key("model-b", "float32"))
    assert not other_model.holds(h(9))
    same_model = pool(seed=2)  # another worker of the same model on this host
    reader = DiskTier(same_model, str(tmp_path), 1 << 20, layout_key("model-a", "float32"))
    assert reader.holds(h(9)) and reader.load(h(9), 0) and torch.equal(same_model[:, :, 0], kv[:, :, 4])
    # The folder's id says who reads whose files: the same for the reader, not the other model.
    assert reader.share_id == writer.share_id != other_model.share_id
    for tier in (writer, other_model, reader):
        tier.close()


def test_workers_starting_together_agree_on_their_folders_id(tmp_path):
    with ThreadPoolExecutor(8) as threads:
        ids = list(threads.map(lambda _: share_id_of(str(tmp_path)), range(32)))
    assert len(set(ids)) == 1 and len(ids[0]) == 32
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert share_id_of(str(elsewhere)) != ids[0]
