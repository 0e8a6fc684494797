"""The host block pool's books: exact ids out and back, the device-pool cap, double frees."""

from __future__ import annotations

import pytest

from tandem.kvcache.swap_pool import SwapPool


def test_blocks_go_out_in_free_list_order_and_come_back_to_its_end() -> None:
    pool = SwapPool(num_blocks=6, num_device_blocks=8)
    assert pool.allocate(2) == [0, 1] and pool.allocate(3) == [2, 3, 4]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 5)
    pool.free([3, 1])
    assert list(pool.free_block_ids) == [5, 3, 1]
    assert pool.allocate(2) == [5, 3]
    pool.free([0, 2, 4, 5, 3])
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0


def test_room_is_the_free_list_and_never_more_than_the_device_pool() -> None:
    """8 host blocks beside a 5-block device pool: at most 5 are ever in use."""
    pool = SwapPool(num_blocks=8, num_device_blocks=5)
    assert pool.can_allocate(5) and not pool.can_allocate(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(RuntimeError, match="not enough free host blocks"):
        pool.allocate(2)
    assert pool.num_used_blocks == 4  # a refused allocation takes nothing


def test_a_small_host_pool_limits_by_its_own_size() -> None:
    pool = SwapPool(num_blocks=3, num_device_blocks=5)
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    assert SwapPool(num_blocks=0, num_device_blocks=5).can_allocate(1) is False


def test_a_double_free_is_caught() -> None:
    pool = SwapPool(num_blocks=4, num_device_blocks=4)
    block_ids = pool.allocate(2)
    pool.free(block_ids)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([block_ids[0]])
