"""The KV copier: whole blocks, every layer and both K and V, to the named blocks only."""

from __future__ import annotations

import torch

from tandem.kvcache.swap_copier import KVSwapper


def test_blocks_swap_out_and_back_into_other_blocks() -> None:
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    cache = torch.randn(3, 2, 6, 4, 2, 5)
    original = cache.clone()
    swapper = KVSwapper(cache, num_host_blocks=4)
    assert swapper.host_cache.shape == (3, 2, 4, 4, 2, 5)
    swapper.swap_out([(1, 3), (4, 0)])
    assert torch.equal(swapper.host_cache[:, :, 3], original[:, :, 1])
    assert torch.equal(swapper.host_cache[:, :, 0], original[:, :, 4])
    cache.zero_()  # the device blocks are reused meanwhile
    swapper.swap_in([(3, 5), (0, 2)])
    assert torch.equal(cache[:, :, 5], original[:, :, 1]) and torch.equal(cache[:, :, 2], original[:, :, 4])
    untouched = [0, 1, 3, 4]
    assert not cache[:, :, untouched].any()


def test_nothing_to_copy_is_a_no_op() -> None:
    cache = torch.randn(1, 2, 2, 2, 1, 2)
    before = cache.clone()
    swapper = KVSwapper(cache, num_host_blocks=0)
    swapper.swap_out([])
    swapper.swap_in([])
    assert torch.equal(cache, before)
