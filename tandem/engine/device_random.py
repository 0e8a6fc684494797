"""Counter-based random numbers for the sampler, made on the logits' device.

Each sampled row has a 53-bit key (crossing to the device with the row's other parameters);
the exponential that token ``t`` gets in that row is a pure function of (key, t): splitmix64
of the key, stepped ``t + 1`` times, done densely in int64 torch ops. No generator state lives
on the device and nothing vocabulary-sized crosses from the host; a row's draws do not depend
on the rest of its batch, nor on the device (CPU and CUDA give the same bits).

A seeded request's key at token position ``p`` is ``draw_key(seed, p)``, so the
draw at ``p`` depends on the seed and ``p`` alone: a request resumed mid-stream elsewhere draws
what it would have drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KEY_BITS = 53
"""Keys are below 2**53, so that they cross exactly inside a float64 parameter buffer."""
_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with its bits (torch multiplies int64 modulo 2**64)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic: clear the copied sign)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (bits as unsigned, arithmetic modulo 2**64)."""
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def mix64_int(x: int) -> int:
    """mix64 on one Python int (the host's side, and the tests' reference)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, position: int) -> int:
    """The seed of a seeded row's generator at token ``position`` (a pure function of both)."""
    return mix64_int(mix64_int(seed + _GOLDEN) + (position + 1) * _GOLDEN) >> (64 - KEY_BITS)


class DrawGenerator(torch.Generator):
    """A host generator that knows its key: the sampler takes the key as it is (no torch op
    on the host, nothing to read back)."""

    key: int
    request_seed: int
    position: int

    def later(self, num_tokens: int) -> DrawGenerator:
        """The generator of the same request ``num_tokens`` positions on (a draft's row)."""
        return draw_generator(self.request_seed, self.position + num_tokens)


def draw_generator(seed: int, position: int) -> DrawGenerator:
    """The generator for the draws at token ``position`` of the request seeded ``seed``."""
    gen = DrawGenerator()
    gen.key, gen.request_seed, gen.position = draw_key(seed, position), seed, position
    gen.manual_seed(gen.key)
    return gen


def generator_later(gen: torch.Generator | None, num_tokens: int) -> torch.Generator | None:
    """The generator of a row ``num_tokens`` positions after ``gen``'s: a DrawGenerator's own
    for that position; any other generator (or None) serves every row, each drawing its next key."""
    return gen.later(num_tokens) if isinstance(gen, DrawGenerator) else gen


UNSEEDED = -1
"""The key of a row without a generator: the device draws it (from its default generator)."""


def row_keys(generators: Sequence[torch.Generator | None]) -> list[int]:
    """One key per row: a DrawGenerator's own key, else the next draw of the row's host
    generator, else UNSEEDED (see device_keys)."""
    return [UNSEEDED if g is None else g.key if isinstance(g, DrawGenerator)
            else int(torch.randint(0, 1 << KEY_BITS, (), generator=g)) for g in generators]


def device_keys(keys: torch.Tensor, any_unseeded: bool) -> torch.Tensor:
    """keys ([rows] int64 on the device, from row_keys) with each UNSEEDED one replaced by a
    draw of the device's default generator (reproducible through torch.manual_seed only)."""
    if not any_unseeded:
        return keys
    drawn = torch.randint(0, 1 << KEY_BITS, keys.shape, dtype=torch.int64, device=keys.device)  # [rows]
    return torch.where(keys == UNSEEDED, drawn, keys)


def _stream(keys: torch.Tensor, count: int, stream: int) -> torch.Tensor:
    """[rows, count] int64 uniform on [0, 2**53): entry j is step j + 1 of splitmix64 from the
    row's base for ``stream`` (separate streams of one key do not overlap in practice)."""
    base = mix64(keys + _signed((stream * _GOLDEN) & _MASK64)).unsqueeze(1)  # [rows, 1]
    steps = torch.arange(1, count + 1, dtype=torch.int64, device=keys.device) * _signed(_GOLDEN)  # [count]
    return _shr(mix64(base + steps), 64 - KEY_BITS)


def uniforms(keys: torch.Tensor, count: int) -> torch.Tensor:
    """``u ~ U[0, 1)`` from each row's key, on ``keys``' device: -> [rows, count] float64
    (exact: 53 bits), independent of the same key's exponentials (another stream).
    keys: [rows] int64, below 2**53."""
    return _stream(keys, count, stream=2).to(torch.float64) * 2.0 ** -KEY_BITS


def exponentials(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``q ~ Exp(1)`` for every token of every row, on ``keys``' device: -> [rows, vocab_size]
    float32, each entry > 0 and finite.

    keys: [rows] int64, below 2**53."""
    bits = _stream(keys, vocab_size, stream=1)  # [rows, vocab_size]: token t is step t + 1
    # NOTE: v in [0, 1) kept fine near 0 (float32 is relative there), so q = -log1p(-v) is 0
    # with probability 2**-53 (then clamped: a token whose q is 0 would always win); v is
    # capped below 1, which bounds q by 16.6, as float32 draws are.
    v = (bits.to(torch.float32) * 2.0 ** -KEY_BITS).clamp_(max=1.0 - 2.0 ** -24)
    return torch.log1p(-v).neg_().clamp_(min=torch.finfo(torch.float32).tiny)
