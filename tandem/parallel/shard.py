"""Which part of the model each tensor-parallel rank holds, and cutting the weights to it.

Megatron-style: q/k/v and gate/up are column-parallel (each rank computes some heads and
some of the MLP's intermediate features), o and down are row-parallel (each rank's partial
sum is all-reduced). Embeddings, norms and the LM head are replicated.

KV heads are split in contiguous ranges, as evenly as they go (3 KV heads over 2 ranks:
2 + 1); a query head stays with its KV head. With more ranks than KV heads, each KV head
is replicated on ``tp // num_kv_heads`` ranks, which split its query heads among them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

import torch

from tandem.config import ModelConfig
from tandem.model.llama import LayerWeights, ModelWeights
from tandem.model.quantization import Weight


@dataclass(frozen=True)
class RankShard:
    """The heads and MLP features of one rank, as ranges of the whole model's."""

    rank: int
    tp: int
    kv_head_start: int
    num_kv_heads: int
    head_start: int
    """First query head (query heads of KV head j are j * group .. (j + 1) * group - 1)."""
    num_heads: int
    intermediate_start: int
    intermediate_size: int

    @property
    def kv_heads(self) -> range:
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)


def even_split(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """-> (start, size) of ``parts`` contiguous ranges covering ``n`` in multiples of ``unit``,
    the first ranges one unit larger when they do not divide evenly."""
    if n % unit:
        raise ValueError(f"{n} is not a multiple of {unit}")
    base, extra = divmod(n // unit, parts)
    sizes = [(base + (i < extra)) * unit for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return list(zip(starts, sizes))


def rank_shards(config: ModelConfig, tp: int) -> list[RankShard]:
    """Each rank's share of ``config``'s heads and MLP, for ``tp`` ranks."""
    num_heads, num_kv_heads = config.num_heads, config.num_kv_heads
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        kv_ranges = even_split(num_kv_heads, tp)
        q_ranges = [(start * group, size * group) for start, size in kv_ranges]
    else:
        replicas = tp // num_kv_heads
        if tp % num_kv_heads or group < replicas:
            raise ValueError(f"tensor_parallel_size {tp} does not fit {num_kv_heads} KV heads with {group} query heads "
                             f"each: use at most {num_kv_heads} ranks, or a multiple of it up to {num_heads}")
        kv_ranges = [(rank // replicas, 1) for rank in range(tp)]
        q_ranges = [(kv * group + start, size) for rank, (kv, _) in enumerate(kv_ranges)
                    for start, size in [even_split(group, replicas)[rank % replicas]]]
    if min(size for _, size in q_ranges) < 1:
        raise ValueError(f"tensor_parallel_size {tp} leaves a rank without query heads")
    # Whole groups of 128 (or 32) features keep int4 groups and GPTQ's on one rank.
    unit = next(u for u in (128, 32, 1) if config.intermediate_size % (u * tp) == 0 or u == 1)
    mlp_ranges = even_split(config.intermediate_size, tp, unit)
    return [RankShard(rank, tp, kv[0], kv[1], q[0], q[1], m[0], m[1])
            for rank, (kv, q, m) in enumerate(zip(kv_ranges, q_ranges, mlp_ranges))]


def shard_weights(weights: ModelWeights, config: ModelConfig, shard: RankShard) -> ModelWeights:
    """The weights rank ``shard.rank`` holds (views or copies of ``weights``' own)."""
    d, h, hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    q_rows = (shard.head_start * d, (shard.head_start + shard.num_heads) * d)
    k_rows = ((h + shard.kv_head_start) * d, (h + shard.kv_head_start + shard.num_kv_heads) * d)
    v_rows = (k_rows[0] + hkv * d, k_rows[1] + hkv * d)
    mlp = (shard.intermediate_start, shard.intermediate_start + shard.intermediate_size)

    def layer(lw: LayerWeights) -> LayerWeights:
        bias = None if lw.qkv_bias is None else torch.cat([lw.qkv_bias[a:b] for a, b in (q_rows, k_rows, v_rows)])
        return dataclasses.replace(
            lw,
            qkv_proj=cat_rows([rows(lw.qkv_proj, *r) for r in (q_rows, k_rows, v_rows)]),
            qkv_bias=bias,
            o_proj=cols(lw.o_proj, *q_rows),
            gate_up_proj=cat_rows([rows(lw.gate_up_proj, *mlp), rows(lw.gate_up_proj, mlp[0] + inter, mlp[1] + inter)]),
            down_proj=cols(lw.down_proj, *mlp),
        )

    return dataclasses.replace(weights, layers=[layer(lw) for lw in weights.layers])


def rows(w: Weight, start: int, end: int) -> Weight:
    """Output channels start:end of a float or quantized weight."""
    return w[start:end] if isinstance(w, torch.Tensor) else w.rows(start, end)


def cols(w: Weight, start: int, end: int) -> Weight:
    """Input channels start:end of a float or quantized weight."""
    return w[:, start:end].contiguous() if isinstance(w, torch.Tensor) else w.cols(start, end)


def cat_rows(parts: list[Weight]) -> Weight:
    """Weights of the same kind stacked along their output channels."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(cast(list[torch.Tensor], parts))  # all of first's kind
    # A quantized weight's per-output-channel tensors all stack along dim 0; its other fields agree.
    fields = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            fields[name] = torch.cat([getattr(p, name) for p in parts])
    return type(first)(**fields)
