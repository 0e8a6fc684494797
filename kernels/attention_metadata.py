"""What attention needs to know about one step's packed batch, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences attended together by the torch path, and how many blocks the longest
    of them spans (known on the host, so that attention slices its tables without a sync)."""

    seq_indices: torch.Tensor
    """[num_seqs_in_group] int64, on the device: rows of the decode tokens."""
    num_blocks: int


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of a packed batch: decode tokens first (one per sequence), then prefill chunks.

    Built once per step by the model runner and shared by every layer.
    """

    slot_mapping: torch.Tensor
    """[num_tokens] int64: the cache slot (block_id * block_size + offset) of each new token."""
    num_decode_tokens: int
    """The first num_decode_tokens tokens are single-token steps of distinct sequences."""
    decode_block_tables: torch.Tensor
    """[num_decode_tokens, max_num_blocks] int64, padded with block 0 beyond each table."""
    decode_context_lens: torch.Tensor
    """[num_decode_tokens] int64: tokens in the cache per decode sequence, this one included."""
    max_decode_context_len: int
    """The largest of decode_context_lens, known on the host (sizes kernels without a sync)."""
    prefill_query_starts: tuple[int, ...]
    """Offset of each prefill chunk among the prefill tokens (those after the decode tokens)."""
    prefill_query_lens: tuple[int, ...]
    """Tokens in each prefill chunk."""
    prefill_context_lens: tuple[int, ...]
    """Tokens in the cache per prefill sequence after this step (cached prefix + chunk)."""
    prefill_block_tables: torch.Tensor
    """[num_prefills, max_num_blocks] int64, padded with block 0 beyond each table."""
    prefill_layout: torch.Tensor
    """[num_prefills, 3] int64: (query start, query length, context length) per chunk, the
    three tuples above as one tensor for kernels."""
    decode_groups: tuple[DecodeGroup, ...] = ()
    """The decode sequences by similar context length, for the torch path (empty: it groups
    them itself, reading the lengths back from the device)."""

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_starts)

    @property
    def max_prefill_query_len(self) -> int:
        return max(self.prefill_query_lens, default=0)
