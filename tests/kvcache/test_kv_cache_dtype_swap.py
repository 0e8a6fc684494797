"""A bfloat16 KV pool (a float32 engine's, --kv-cache-dtype bfloat16) swaps in its own dtype:
the host pool is bfloat16 too, and blocks come back bit for bit, whatever the head size."""

from __future__ import annotations

import pytest
import torch

from tandem.kvcache.swap_copier import KVSwapper


# (layers, block_size, heads, head_dim): a real model's shape, and one whose block is 20 bytes
# (not a multiple of 8: the swap-in buffer's int64 ids must still be aligned).
@pytest.mark.parametrize("shape", [(3, 4, 2, 64), (1, 1, 1, 5)])
def test_a_bf16_pool_swaps_out_and_back_bit_for_bit(shape) -> None:
    layers, block_size, heads, dim = shape
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(layers, 2, 6, block_size, heads, dim, generator=gen).to(torch.bfloat16)
    original = cache.clone()
    swapper = KVSwapper(cache, num_host_blocks=4)
    assert swapper.host_cache.dtype == torch.bfloat16 and swapper.host_cache.shape[2] == 4
    swapper.swap_out([(1, 3), (4, 0), (5, 1)])
    cache.zero_()  # the device blocks are reused meanwhile
    swapper.swap_in([(3, 5), (0, 2), (1, 0)])
    assert torch.equal(cache[:, :, 5], original[:, :, 1]) and torch.equal(cache[:, :, 2], original[:, :, 4])
    assert torch.equal(cache[:, :, 0], original[:, :, 5])
    assert not cache[:, :, [1, 3, 4]].any()
    swapper.copy([(5, 3)])  # copy-on-write inside the pool
    assert torch.equal(cache[:, :, 3], original[:, :, 1])
