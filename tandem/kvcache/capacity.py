"""How many tokens a KV pool holds: one formula for the engine's start-up log and ``tandem plan``.

One token's K and V, across every layer, on one rank take

    bytes_per_token = 2 (K and V) × num_layers × kv_heads_per_rank × head_dim × bytes per element

where, with tensor parallelism over ``tp`` ranks, each rank holds

    kv_heads_per_rank = ceil(num_kv_heads / tp)    (at least 1)

KV heads: an even split when ``tp`` divides ``num_kv_heads``; one head per rank (replicated)
when there are fewer KV heads than ranks; and for an uneven split the busiest rank's share,
which bounds the pool since every rank holds the same number of blocks. So a rank's bytes
per token shrink about ``tp`` times and its capacity per GiB grows as much, until
``tp >= num_kv_heads`` (then it stays at one head per rank).

A pool of ``memory_bytes`` holds ``memory_bytes // (block_size × bytes_per_token)`` blocks:
exactly how :meth:`tandem.config.EngineConfig.build` sizes it from ``kv_cache_memory_gib``
(after :func:`tandem.config.gib_to_bytes`, the same rounding), by the same formula: tandem/config/
holds it (so config imports nothing of kvcache). Torch-free, so ``tandem plan`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import EngineConfig, kv_bytes_per_token


@dataclass(frozen=True)
class KVCapacity:
    """A paged KV pool on one rank: its blocks, tokens, and how many full-length sequences fit."""

    bytes_per_token: int
    """K and V of one token across all layers, on one rank."""
    block_size: int
    """Tokens per block."""
    num_blocks: int
    max_model_len: int
    """The context length concurrency is counted at (never more than the pool holds)."""
    tp: int = 1

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds: num_blocks × block_size."""
        return self.num_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def pool_bytes(self) -> int:
        """Bytes of the pool on one rank (the engine allocates exactly this)."""
        return self.num_blocks * self.block_bytes

    @property
    def max_concurrency(self) -> float:
        """num_tokens / max_model_len: sequences of max_model_len tokens the pool holds, as a ratio."""
        return self.num_tokens / self.max_model_len

    @property
    def max_full_length_seqs(self) -> int:
        """Sequences of max_model_len tokens that fit at once, whole blocks each:
        num_blocks // ceil(max_model_len / block_size) (<= floor(max_concurrency))."""
        return self.num_blocks // -(-self.max_model_len // self.block_size)

    @classmethod
    def from_memory(cls, memory_bytes: int, *, block_size: int, dtype_bytes: int, num_layers: int,
                    num_kv_heads: int, head_dim: int, max_model_len: int, tp: int = 1) -> KVCapacity:
        """The pool ``memory_bytes`` (per rank) holds; ValueError when not even one block.

        max_model_len: the configured context length, capped here at the pool's tokens
        (as the engine caps it)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        bytes_per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes, tp)
        block_bytes = block_size * bytes_per_token
        num_blocks = int(memory_bytes) // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"{memory_bytes} bytes of KV memory per rank hold no block ({block_bytes} bytes: "
                f"{block_size} tokens of {bytes_per_token} bytes)"
            )
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        return cls(bytes_per_token, block_size, num_blocks, min(max_model_len, num_blocks * block_size), tp)

    @classmethod
    def of_engine_config(cls, config: EngineConfig) -> KVCapacity:
        """The pool an engine built from ``config`` holds (on each rank, under tensor parallelism)."""
        tp = config.tensor_parallel_size
        bytes_per_token = config.model.kv_bytes_per_token(config.kv_cache_dtype_name, tp)
        return cls(bytes_per_token, config.block_size, config.num_kv_blocks, config.max_model_len, tp)

    def full_length_text(self) -> str:
        """'N sequence(s) at full length': max_full_length_seqs in words."""
        n = self.max_full_length_seqs
        return f"{n} sequence{'' if n == 1 else 's'} at full length"

    def describe(self) -> str:
        """One line: blocks, tokens, MiB, bytes per token and max concurrency at max_model_len."""
        per_rank = f" per rank of tp={self.tp}" if self.tp > 1 else ""
        return (
            f"{self.num_blocks} blocks of {self.block_size} tokens ({self.num_tokens} tokens, "
            f"{self.pool_bytes / 2**20:.1f} MiB, {self.bytes_per_token} bytes/token{per_rank}); "
            f"max concurrency {self.max_concurrency:.2f}x at max_model_len {self.max_model_len} "
            f"({self.full_length_text()})"
        )
