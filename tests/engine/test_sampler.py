"""Sampler: greedy, per-row seeded determinism, filters and the sampled distribution; the
counter-based random numbers (device_random.py) against a plain-int reference, and a seeded
draw that depends on the seed and the position alone."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.engine.device_random import KEY_BITS, draw_generator, draw_key, exponentials, mix64_int, uniforms
from tandem.engine.sampler import Sampler, SamplerOutput
from tandem.sampling_params import SamplingParams

VOCAB = 64


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draw(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws of one row (as a batch of n copies, one generator each)."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    gens = [_gen(seed * 1_000_003 + i) for i in range(n)]
    out = Sampler().sample(logits, [params] * n, gens)
    return torch.tensor(out.token_ids)


def test_greedy_is_argmax() -> None:
    logits = _logits(8, vocab=1000)
    logits[3, 17] = logits[3].max() + 1.0
    logits[5, :] = 0.0  # all tied: argmax takes the lowest index
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 8, [None] * 8)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert out.token_ids[3] == 17 and out.token_ids[5] == 0


def test_greedy_accepts_half_precision() -> None:
    logits = _logits(4, vocab=500).to(torch.bfloat16)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert out.token_ids == torch.argmax(logits.float(), dim=-1).tolist()


def test_seeded_rows_repeat_and_ignore_the_rest_of_the_batch() -> None:
    vocab = 5000
    target_logits = _logits(1, vocab=vocab, seed=42, scale=1.0)[0]
    target = SamplingParams(temperature=1.3, top_p=0.95, top_k=400, seed=7)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=2.0, min_p=0.1),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(),
    ]

    def run(batch_size: int, position: int, other_seed: int) -> list[int]:
        """Sample the target row 5 steps in a batch of the given size, at the given position."""
        assert target.seed is not None
        gen = _gen(target.seed)
        other_gens = [_gen(other_seed + j) for j in range(batch_size)]
        tokens = []
        for step in range(5):
            logits = _logits(batch_size, vocab=vocab, seed=other_seed + step)
            logits[position] = target_logits + step  # the shift does not change the distribution
            params = [others[(j + other_seed) % len(others)] for j in range(batch_size)]
            params[position] = target
            gens: list[torch.Generator | None] = [
                other_gens[j] if j % 2 else None for j in range(batch_size)
            ]
            gens[position] = gen
            out = Sampler().sample(logits, params, gens)
            tokens.append(out.token_ids[position])
        return tokens

    reference = run(batch_size=1, position=0, other_seed=0)
    assert len(set(reference)) > 1, "five draws from a flat 5000-token distribution should differ"
    assert run(batch_size=1, position=0, other_seed=0) == reference
    assert run(batch_size=7, position=3, other_seed=11) == reference
    assert run(batch_size=32, position=31, other_seed=5) == reference
    assert run(batch_size=2, position=0, other_seed=99) == reference


def test_different_seeds_differ() -> None:
    logits = _logits(1, vocab=5000, scale=0.5)
    params = [SamplingParams(seed=1)]
    a = [Sampler().sample(logits, params, [_gen(s)]).token_ids[0] for s in range(20)]
    assert len(set(a)) > 10


def test_top_k_stays_in_the_k_most_likely() -> None:
    logits = _logits(1, vocab=200, seed=3, scale=1.0)[0]
    for k in (1, 5, 17):
        allowed = set(torch.topk(logits, k).indices.tolist())
        drawn = _draw(logits, SamplingParams(temperature=1.5, top_k=k), n=3000, seed=k)
        assert set(drawn.tolist()) <= allowed
        if k > 1:
            assert len(set(drawn.tolist())) == k  # flat enough that every allowed token shows up


@pytest.mark.parametrize("top_k", [0, -1, VOCAB, VOCAB + 5])
def test_top_k_disabled_values_keep_everything(top_k: int) -> None:
    logits = torch.zeros(VOCAB)
    drawn = _draw(logits, SamplingParams(top_k=top_k), n=4000)
    assert len(set(drawn.tolist())) == VOCAB


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """Smallest set of most likely tokens with mass >= top_p, in float64."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    # Guard the test itself: no boundary so close that float32 could round across it.
    assert (cumulative - top_p).abs().min().item() > 1e-5
    size = int((cumulative < top_p).sum().item()) + 1
    return set(order[:size].tolist())


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.62, 0.9])
def test_top_p_stays_in_the_nucleus(top_p: float) -> None:
    logits = _logits(1, vocab=300, seed=5, scale=1.5)[0]
    temperature = 0.8
    allowed = _nucleus(logits, temperature, top_p)
    drawn = set(_draw(logits, SamplingParams(temperature=temperature, top_p=top_p), n=3000).tolist())
    assert drawn <= allowed
    assert int(torch.argmax(logits)) in drawn
    assert (len(drawn) > 1) == (len(allowed) > 1)


def test_top_p_applies_after_top_k() -> None:
    logits = _logits(1, vocab=300, seed=8, scale=1.0)[0]
    k, top_p = 20, 0.5
    kept = torch.full_like(logits, float("-inf"))
    top = torch.topk(logits, k).indices
    kept[top] = logits[top]
    allowed = _nucleus(kept, 1.0, top_p)
    drawn = set(_draw(logits, SamplingParams(top_k=k, top_p=top_p), n=3000).tolist())
    assert drawn <= allowed and len(drawn) > 1


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.8])
def test_min_p_drops_unlikely_tokens(min_p: float) -> None:
    logits = _logits(1, vocab=300, seed=9, scale=1.5)[0]
    temperature = 1.2
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ratio = probs / probs.max()
    assert (ratio - min_p).abs().min().item() > 1e-5
    allowed = set(torch.nonzero(ratio >= min_p).flatten().tolist())
    drawn = set(_draw(logits, SamplingParams(temperature=temperature, min_p=min_p), n=3000).tolist())
    assert drawn <= allowed
    assert len(drawn) == len(allowed) or len(allowed) > 30


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_the_tempered_softmax(temperature: float) -> None:
    vocab, n = 8, 20000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    drawn = _draw(logits, SamplingParams(temperature=temperature), n=n)
    observed = torch.bincount(drawn, minlength=vocab).double()
    chi2 = (((observed - n * expected) ** 2) / (n * expected)).sum().item()
    # 7 degrees of freedom: P(chi2 > 29) < 1e-4; the draws are seeded, so this is not flaky.
    assert chi2 < 29.0, (observed / n, expected)
    tv = 0.5 * (observed / n - expected).abs().sum().item()
    assert tv < 0.02


def test_default_generator_samples_the_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]]).expand(20000, -1).contiguous()
    out = Sampler().sample(logits, [SamplingParams()] * 20000, [None] * 20000)
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=4).double() / 20000
    expected = torch.softmax(logits[0].double(), dim=-1)
    assert 0.5 * (observed - expected).abs().sum().item() < 0.02


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = _logits(6, vocab=2000, seed=4, scale=4.0)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.3, top_k=5),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(),
    ]
    out = Sampler().sample(logits, params, [_gen(i) for i in range(6)])
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        assert math.isclose(logprob, reference[row, token].item(), abs_tol=1e-5)
    # Greedy row's logprob is the top log-prob; temperature does not enter the reported value.
    assert math.isclose(out.logprobs[0], reference[0].max().item(), abs_tol=1e-5)


def test_top_logprobs_are_the_raw_log_softmaxs_best() -> None:
    """Each row gets its own count (0: none) of the best tokens, most likely first, under the
    raw logits' log_softmax (float64 reference), whatever processing changed the choice."""
    logits = _logits(4, vocab=3000, seed=9, scale=4.0)
    processed = logits.clone()
    processed[:, 7] = 1e4  # what a logit bias would do: every row now chooses token 7
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(logprobs=0),
              SamplingParams(temperature=0.8, seed=1, logprobs=20), SamplingParams(temperature=0.0)]
    out = Sampler().sample(processed, params, [_gen(i) for i in range(4)], raw_logits=logits)
    assert out.token_ids == [7, 7, 7, 7]
    reference = torch.log_softmax(logits.double(), dim=-1).sort(dim=-1, descending=True)
    assert out.top_logprobs is not None
    assert [len(t.token_ids) for t in out.top_logprobs] == [5, 0, 20, 0]
    for row, top in enumerate(out.top_logprobs):
        n = len(top.token_ids)
        assert top.token_ids == reference.indices[row, :n].tolist()
        assert top.logprobs == pytest.approx(reference.values[row, :n].tolist(), abs=1e-5)
    assert Sampler().sample(logits, [SamplingParams(logprobs=0)] * 4, [None] * 4).top_logprobs is None


def test_shape_errors() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [None, None])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(4), [SamplingParams()], [None])
    assert Sampler().sample(torch.zeros(0, 4), [], []) == SamplerOutput([], [])


def _splitmix_exponential(key: int, token: int) -> float:
    """device_random.exponentials for one entry, in plain Python ints and float64."""
    golden, mask = 0x9E3779B97F4A7C15, (1 << 64) - 1
    base = mix64_int((key + golden) & mask)
    bits = mix64_int((base + (token + 1) * golden) & mask) >> (64 - KEY_BITS)
    v = min(float(torch.tensor(bits * 2.0 ** -KEY_BITS, dtype=torch.float32)), 1.0 - 2.0 ** -24)
    return -math.log1p(-v)


def test_exponentials_are_splitmix64_in_int64_torch_ops() -> None:
    """The int64 tensor arithmetic wraps as unsigned 64-bit arithmetic does, for keys up to
    2**53 and every token id of the default vocabulary."""
    keys = [0, 1, 12345, (1 << KEY_BITS) - 1, draw_key(7, 1000)]
    q = exponentials(torch.tensor(keys), 49152).double()
    for row, key in enumerate(keys):
        for token in (0, 1, 31, 4097, 49151):
            assert q[row, token].item() == pytest.approx(_splitmix_exponential(key, token), rel=1e-6)


def test_exponentials_are_exp_1() -> None:
    q = exponentials(torch.arange(64) * 7919, 5000).double()  # [64, 5000]
    assert bool((q > 0).all()) and bool(torch.isfinite(q).all())
    assert q.mean().item() == pytest.approx(1.0, abs=0.01) and q.var().item() == pytest.approx(1.0, abs=0.03)
    # P(q > 2) = e**-2; neighbouring tokens and rows uncorrelated.
    assert (q > 2).double().mean().item() == pytest.approx(math.exp(-2), abs=0.003)
    assert abs(torch.corrcoef(torch.stack([q[:, :-1].flatten(), q[:, 1:].flatten()]))[0, 1].item()) < 0.01
    assert abs(torch.corrcoef(torch.stack([q[:-1].flatten(), q[1:].flatten()]))[0, 1].item()) < 0.01
    # The same keys' uniforms (speculative verification's) are another stream: U[0, 1), unrelated to q.
    u = uniforms(torch.arange(64) * 7919, 5000)  # [64, 5000] float64
    assert bool((u >= 0).all() and (u < 1).all()) and u.mean().item() == pytest.approx(0.5, abs=0.005)
    assert abs(torch.corrcoef(torch.stack([u.flatten(), q.flatten()]))[0, 1].item()) < 0.01


def test_a_seeded_draw_depends_on_the_seed_and_position_alone() -> None:
    """The model runner's generators: same (seed, position), same token, in any batch; another
    position or seed, another stream."""
    vocab = 5000
    logits = _logits(1, vocab=vocab, seed=3, scale=0.5)  # flat: draws differ
    params = SamplingParams(temperature=1.0, seed=1)

    def draw(seed: int, position: int, batch: int = 1, row: int = 0) -> int:
        rows = _logits(batch, vocab=vocab, seed=batch)
        rows[row] = logits[0]
        gens: list[torch.Generator | None] = [None] * batch
        gens[row] = draw_generator(seed, position)
        return Sampler().sample(rows, [params] * batch, gens).token_ids[row]

    tokens = [draw(1, p) for p in range(100, 120)]
    assert [draw(1, p, batch=6, row=p % 6) for p in range(100, 120)] == tokens
    assert len(set(tokens)) > 15
    assert sum(a != b for a, b in zip(tokens, [draw(2, p) for p in range(100, 120)])) > 15
    assert draw_key(1, 100) != draw_key(1, 101) and draw_key(1, 100) < 1 << KEY_BITS


def test_a_request_resumed_mid_stream_draws_what_it_would_have(make_llm, tokenizer) -> None:
    """Seeded sampling: continuing from the first half of a completion (as another worker
    would, from the tokens alone) draws the second half again."""
    llm = make_llm()
    prompt = tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, seed=77, ignore_eos=True)
    whole = llm.generate([prompt], params)[0].token_ids
    resumed = llm.generate([prompt + whole[:4]], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=4,
                                                                 seed=77, ignore_eos=True))[0].token_ids
    assert len(whole) == 8 and resumed == whole[4:]
