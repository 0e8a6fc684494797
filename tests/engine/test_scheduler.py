"""Scheduler: FCFS, token budget, chunked prefill, preemption, stops, abort, and a seeded
random-workload property test, all driven the way the engine drives it (schedule, then
update with one sampled token per sampling entry). Pure Python: no model is loaded."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.sampler import StepOutput
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence, SequenceStatus as St
from tandem.kvcache.block_manager import BlockManager
from tandem.sampling_params import SamplingParams

EOS = 2
MODEL = ModelConfig(
    name="fake", architecture="LlamaForCausalLM", num_layers=1, hidden_size=8, intermediate_size=16,
    num_heads=1, num_kv_heads=1, head_dim=8, vocab_size=100_000, rms_norm_eps=1e-6, attention_bias=False,
    tie_word_embeddings=False, max_position_embeddings=4096, sliding_window=None, eos_token_ids=(EOS,),
)
_arrivals = itertools.count()
_prompts = itertools.count()


def _sched(num_kv_blocks: int = 64, block_size: int = 4, **kw) -> Scheduler:
    cfg = EngineConfig.build(MODEL, num_kv_blocks=num_kv_blocks, block_size=block_size, **kw)
    return Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching))


def _add(sched: Scheduler, rid: str, prompt: int | list[int], arrival: int | None = None, **params) -> Sequence:
    if isinstance(prompt, int):  # distinct tokens per request: no accidental prefix hits
        start = 1000 * (1 + next(_prompts))
        prompt = list(range(start, start + prompt))
    params.setdefault("max_tokens", 100)
    seq = Sequence(rid, prompt, SamplingParams(**params), next(_arrivals) if arrival is None else arrival)
    sched.add(seq)
    return seq


def _step(sched: Scheduler, token: int | dict[str, int] = 7) -> list[tuple[str, int, bool]]:
    """One engine step; returns (request_id, num_new_tokens, samples) per batch entry."""
    batch = sched.schedule()
    entries = [(s.request_id, n, batch.samples(i)) for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))]
    toks = [token if isinstance(token, int) else token[r] for r, _, samples in entries if samples]
    updates = sched.update(batch, StepOutput([[t] for t in toks], [[-0.5] for _ in toks]))
    assert [u.new_token_ids for u in updates] == [[t] for t in toks]
    return entries


def _all_free(sched: Scheduler) -> bool:
    bm = sched.block_manager
    return bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_fcfs_admission_then_decodes() -> None:
    """Prompts are admitted whole in arrival order, then each decodes one token a step."""
    sched = _sched()
    a, b, c = _add(sched, "a", 5), _add(sched, "b", 6), _add(sched, "c", 7)
    assert _step(sched) == [("a", 5, True), ("b", 6, True), ("c", 7, True)]
    assert sched.running == [a, b, c] and not sched.waiting
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2, 3], [4, 5])
    assert _step(sched, {"a": 11, "b": 12, "c": 13}) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert (a.output_token_ids, b.output_token_ids, a.output_logprobs) == ([7, 11], [7, 12], [-0.5, -0.5])


def test_chunked_prefill_splits_a_long_prompt() -> None:
    """100 tokens under a 32-token budget run as 32, 32, 32, 4; only the last chunk samples."""
    sched = _sched(num_kv_blocks=16, block_size=16, max_num_batched_tokens=32)
    seq = _add(sched, "a", 100)
    expect = [(32, False, 2), (32, False, 4), (32, False, 6), (4, True, 7)]
    for n, samples, num_blocks in expect:
        assert _step(sched) == [("a", n, samples)]
        assert seq.block_ids == list(range(num_blocks))
        assert seq.num_output_tokens == int(samples)
    assert seq.num_computed_tokens == 100 and _step(sched) == [("a", 1, True)]


def test_token_budget_is_shared_and_decodes_come_first() -> None:
    """Running sequences take the budget first; what is left goes to new prompts, chunked."""
    sched = _sched(max_num_batched_tokens=16)
    _add(sched, "a", 10), _add(sched, "b", 10), _add(sched, "c", 3), _add(sched, "d", 30)
    assert _step(sched) == [("a", 10, True), ("b", 6, False)]
    assert _step(sched) == [("a", 1, True), ("b", 4, True), ("c", 3, True), ("d", 8, False)]
    assert _step(sched) == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("d", 13, False)]
    assert _step(sched) == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("d", 9, True)]


def test_decodes_are_listed_before_an_older_sequences_prefill_chunk() -> None:
    """Even when the running order puts a prefill chunk first, single-token entries lead."""
    sched = _sched(max_num_batched_tokens=16)
    _add(sched, "new", 2, arrival=10**9 + 1)
    _add(sched, "old", 20, arrival=10**9)  # older, but queued second
    assert _step(sched) == [("new", 2, True), ("old", 14, False)]
    assert [s.request_id for s in sched.running] == ["new", "old"]
    assert _step(sched) == [("new", 1, True), ("old", 6, True)]
    assert [s.request_id for s in sched.running] == ["old", "new"]  # sorted by arrival


def test_max_num_seqs_caps_the_running_set() -> None:
    """A third request waits until one of the two running ones finishes."""
    sched = _sched(max_num_seqs=2)
    a, b, c = (_add(sched, r, 3, max_tokens=m) for r, m in (("a", 2), ("b", 3), ("c", 1)))
    assert _step(sched) == [("a", 3, True), ("b", 3, True)]
    assert _step(sched) == [("a", 1, True), ("b", 1, True)]
    assert a.status == St.FINISHED_LENGTH and list(sched.waiting) == [c]
    assert _step(sched) == [("b", 1, True), ("c", 3, True)]
    assert (b.status, c.status) == (St.FINISHED_LENGTH, St.FINISHED_LENGTH) and _all_free(sched)


def test_without_chunked_prefill_a_prompt_runs_whole() -> None:
    """The budget rises to max_model_len and a prompt that does not fit waits whole."""
    sched = _sched(max_model_len=64, max_num_batched_tokens=16, enable_chunked_prefill=False)
    assert sched.config.max_num_batched_tokens == 64
    _add(sched, "a", 50), _add(sched, "b", 40), _add(sched, "c", 5)
    assert _step(sched) == [("a", 50, True)]  # b would need 40 of the 14 left; c waits behind
    assert _step(sched) == [("a", 1, True), ("b", 40, True), ("c", 5, True)]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_the_newest_sequence(prefix_caching: bool) -> None:
    """Out of blocks, the newest running sequence is freed, goes to the waiting front and
    later reruns prompt + generated tokens (from its surviving cached prefix, if any)."""
    sched = _sched(num_kv_blocks=4, enable_prefix_caching=prefix_caching, preemption_mode="recompute")
    a = _add(sched, "a", 7, max_tokens=3)
    b = _add(sched, "b", list(range(30, 37)), max_tokens=4)
    assert _step(sched, {"a": 11, "b": 21}) == [("a", 7, True), ("b", 7, True)]
    c = _add(sched, "c", 3, max_tokens=1)
    assert _step(sched, {"a": 12, "b": 22}) == [("a", 1, True), ("b", 1, True)]
    assert (a.block_ids, b.block_ids, list(sched.waiting)) == ([0, 1], [2, 3], [c])
    assert _step(sched, {"a": 13}) == [("a", 1, True)]  # a needs a 3rd block: b gives way
    assert (b.status, b.block_ids, b.num_computed_tokens, b.num_preemptions) == (St.WAITING, [], 0, 1)
    assert list(sched.waiting) == [b, c] and sched.preemptor.num_preemptions == 1
    assert a.status == St.FINISHED_LENGTH and a.output_token_ids == [11, 12, 13]
    assert list(sched.block_manager.free_block_ids) == [2, 3, 1, 0]
    # b's first block (block 2) survived in the cache; its second (block 3) went to a.
    b_first = 5 if prefix_caching else 9
    assert _step(sched, {"b": 23, "c": 31}) == [("b", b_first, True), ("c", 3, True)]
    assert b.block_ids == [2, 3, 1] and c.status == St.FINISHED_LENGTH
    assert b.num_cached_prompt_tokens == 0  # counted at first admission only
    assert _step(sched, {"b": 24}) == [("b", 1, True)]
    assert b.output_token_ids == [21, 22, 23, 24] and b.status == St.FINISHED_LENGTH
    assert _all_free(sched) and not sched.has_unfinished


def test_a_step_that_preempts_admits_nothing() -> None:
    """A sequence that cannot grow and is the newest preempts itself; though a chunk of it
    would fit in the blocks it just freed, it is only readmitted on the next step."""
    sched = _sched(num_kv_blocks=5, max_num_batched_tokens=5, enable_prefix_caching=False, preemption_mode="recompute")
    a, b = _add(sched, "a", 3), _add(sched, "b", 3)
    assert _step(sched) == [("a", 3, True), ("b", 2, False)]
    for _ in range(6):  # pool fills: a [0, 2, 4], b [1, 3]
        assert _step(sched) == [("a", 1, True), ("b", 1, True)]
    assert (a.block_ids, b.block_ids, b.num_tokens) == ([0, 2, 4], [1, 3], 9)
    assert _step(sched) == [("a", 1, True)]  # b needed a 3rd block: preempted itself
    assert list(sched.block_manager.free_block_ids) == [3, 1] and list(sched.waiting) == [b]
    assert _step(sched) == [("a", 1, True), ("b", 4, False)] and b.block_ids == [3]


@pytest.mark.parametrize("params, max_model_len, tokens, status", [
    (dict(), None, [7, EOS], St.FINISHED_STOPPED),
    (dict(ignore_eos=True, max_tokens=3), None, [EOS, EOS, EOS], St.FINISHED_LENGTH),
    (dict(stop_token_ids=(42,)), None, [41, 7, 42], St.FINISHED_STOPPED),
    (dict(max_tokens=3), None, [7, 8, 9], St.FINISHED_LENGTH),
    (dict(max_tokens=50), 12, [7, 8, 9], St.FINISHED_LENGTH),  # prompt 9 + 3 = max_model_len
])
def test_stop_conditions(params: dict, max_model_len: int | None, tokens: list[int], status: St) -> None:
    """EOS, stop_token_ids, max_tokens and max_model_len end a request on the exact token."""
    sched = _sched(max_model_len=max_model_len)
    params.setdefault("max_tokens", 100)
    seq = _add(sched, "a", 9, **params)
    for i, t in enumerate(tokens):
        assert seq.status == (St.WAITING if i == 0 else St.RUNNING)
        _step(sched, t)
    assert seq.status == status and seq.output_token_ids == tokens
    assert seq.block_ids == [] and not sched.has_unfinished and _all_free(sched)


def test_abort_from_waiting_and_running_frees_every_block() -> None:
    """Abort finds a request in either queue, marks it aborted and drops its references."""
    sched = _sched(num_kv_blocks=8, max_num_batched_tokens=9)
    bm = sched.block_manager
    a = _add(sched, "a", list(range(10, 19)))
    _step(sched)  # a: blocks 0, 1 full and cached
    b = _add(sched, "b", list(range(10, 18)) + list(range(50, 60)))
    c = _add(sched, "c", 4)
    assert _step(sched) == [("a", 1, True), ("b", 8, False)]  # b: 8 cached + an 8-token chunk
    assert (a.block_ids, b.block_ids, bm.ref_counts[:5]) == ([0, 1, 2], [0, 1, 3, 4], [2, 2, 1, 1, 1])
    assert b.num_cached_prompt_tokens == 8
    assert sched.abort("b") is b and b.status == St.FINISHED_ABORTED and b.finish_reason == "abort"
    assert b.block_ids == [] and bm.ref_counts[:5] == [1, 1, 1, 0, 0]
    assert list(bm.free_block_ids) == [5, 6, 7, 4, 3] and sched.running == [a]
    assert sched.abort("b") is None and sched.abort("nope") is None
    assert sched.abort("c") is c and c.status == St.FINISHED_ABORTED and not sched.waiting
    assert sched.abort("a") is a and a.status == St.FINISHED_ABORTED
    assert _all_free(sched) and not sched.has_unfinished


# -- property test: random workloads with random aborts --------------------------------------


def _check_books(sched: Scheduler) -> None:
    """Ref counts equal table memberships; only cached prefix blocks are shared; the host
    blocks in use are exactly the swapped sequences', never more than the device pool."""
    bm, bs, pool = sched.block_manager, sched.block_manager.block_size, sched.preemptor.swap_pool
    live = [*sched.waiting, *sched.running, *sched.swapped]
    assert len({id(s) for s in live}) == len(live)
    assert all(s.status == St.WAITING for s in sched.waiting) and all(s.status == St.RUNNING for s in sched.running)
    assert all(s.status == St.SWAPPED for s in sched.swapped)
    host_ids = [b for s in sched.swapped for b in s.host_block_ids]
    assert sorted(host_ids) == sorted(set(range(pool.num_blocks)) - set(pool.free_block_ids))
    assert len(host_ids) == pool.num_used_blocks <= bm.num_blocks
    for s in sched.swapped:
        assert s.block_ids == [] and len(s.host_block_ids) == bm.num_blocks_for(s.num_computed_tokens) > 0
    assert all(s.host_block_ids == [] for s in (*sched.waiting, *sched.running))
    holders: dict[int, list[tuple[Sequence, int]]] = defaultdict(list)
    for s in (*sched.waiting, *sched.running):
        assert len(set(s.block_ids)) == len(s.block_ids)
        assert s.num_computed_tokens <= len(s.block_ids) * bs and len(s.block_hashes) <= len(s.block_ids)
        if s.status == St.WAITING:
            assert s.block_ids == [] and s.num_computed_tokens == 0
        for i, b in enumerate(s.block_ids):
            holders[b].append((s, i))
            if i < len(s.block_hashes) and bm.block_hash[b] is not None:
                assert bm.block_hash[b] == s.block_hashes[i]
    assert bm.ref_counts == [len(holders[b]) for b in range(bm.num_blocks)]
    assert set(bm.free_block_ids) == {b for b in range(bm.num_blocks) if not holders[b]}
    for b, hs in holders.items():
        if len(hs) > 1:  # shared: a registered, full, computed block at the same table index
            assert bm.block_hash[b] is not None and len({i for _, i in hs}) == 1
            assert all(i < s.num_computed_tokens // bs for s, i in hs)
    assert {bm.block_hash[b]: b for b in bm.cached_block_ids.values()} == bm.cached_block_ids
    assert sum(h is not None for h in bm.block_hash) == len(bm.cached_block_ids)


def _copy_blocks(src: dict[int, tuple], dst: dict[int, tuple], block_pairs: list[tuple[int, int]], bs: int) -> None:
    for src_block, dst_block in block_pairs:
        for i in range(bs):
            dst.pop(dst_block * bs + i, None)
            if src_block * bs + i in src:
                dst[dst_block * bs + i] = src[src_block * bs + i]


def _check_batch_and_kv(sched: Scheduler, batch, kv: dict[int, tuple], host_kv: dict[int, tuple]) -> None:
    """The batch obeys the limits; the KV cache (simulated: a slot holds its token's whole
    prefix; swaps copied first, as the runner does) is right for every computed token; new
    tokens go only to private, unhashed blocks."""
    cfg, bm, bs = sched.config, sched.block_manager, sched.block_manager.block_size
    _copy_blocks(kv, host_kv, batch.swap_out, bs)
    _copy_blocks(host_kv, kv, batch.swap_in, bs)
    ns = batch.num_new_tokens
    assert 0 < batch.num_tokens <= cfg.max_num_batched_tokens and len(sched.running) <= cfg.max_num_seqs
    assert ns == sorted(ns, key=lambda n: n != 1) and min(ns) >= 1
    assert len({id(s) for s in batch.seqs}) == len(ns) and all(s in sched.running for s in batch.seqs)
    for seq, n in zip(batch.seqs, ns):
        start = seq.num_computed_tokens
        assert start + n <= seq.num_tokens <= cfg.max_model_len
        if not cfg.enable_chunked_prefill:
            assert start + n == seq.num_tokens
        slots = bm.slot_ids(seq, 0, start + n)
        for p in range(start):
            assert kv[slots[p]] == tuple(seq.token_ids[:p + 1]), (seq, p)
        for p in range(start, start + n):
            b = seq.block_ids[p // bs]
            assert bm.ref_counts[b] == 1 and bm.block_hash[b] is None
            kv[slots[p]] = tuple(seq.token_ids[:p + 1])


def _first_stop(seq: Sequence, max_model_len: int) -> tuple[int, St] | None:
    """Oracle: index of the output token that should have ended ``seq``, and how."""
    p = seq.params
    for i, t in enumerate(seq.output_token_ids):
        if (t == EOS and not p.ignore_eos) or t in p.stop_token_ids:
            return i, St.FINISHED_STOPPED
        if i + 1 >= p.max_tokens or seq.num_prompt_tokens + i + 1 >= max_model_len:
            return i, St.FINISHED_LENGTH
    return None


def _random_workload(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(3, 16)
    chunked = rng.random() < 0.7
    sched = _sched(
        num_kv_blocks=num_blocks, block_size=bs, max_model_len=rng.randint(2, num_blocks * bs),
        max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 40),
        enable_prefix_caching=rng.random() < 0.8, enable_chunked_prefill=chunked,
        num_swap_blocks=rng.randint(0, num_blocks), preemption_mode=rng.choice(["auto", "swap", "recompute"]),
    )
    max_len = sched.config.max_model_len
    bases = [[rng.randint(10, 13) for _ in range(rng.randint(0, 24))] for _ in range(3)]
    kv: dict[int, tuple] = {}
    host_kv: dict[int, tuple] = {}
    seqs: list[Sequence] = []
    num_requests = rng.randint(1, 20)
    for _ in range(3000):
        if len(seqs) < num_requests and rng.random() < 0.5:
            prompt = (rng.choice(bases) + [rng.randint(10, 13) for _ in range(rng.randint(0, 9))])[:max_len - 1]
            params = dict(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.3,
                          stop_token_ids=rng.choice([(), (13,)]))
            seqs.append(_add(sched, f"r{len(seqs)}", prompt or [10], **params))
        if seqs and rng.random() < 0.05:
            victim = rng.choice(seqs)
            was_live = not victim.status.is_finished
            assert (sched.abort(victim.request_id) is victim) == was_live
            assert victim.status.is_finished and victim.block_ids == []
        _check_books(sched)
        if not sched.has_unfinished:
            if len(seqs) == num_requests:
                break
            continue
        batch = sched.schedule()
        _check_books(sched)
        _check_batch_and_kv(sched, batch, kv, host_kv)
        k = sum(batch.samples(i) for i in range(len(batch.seqs)))
        toks = [rng.choice([EOS, 10, 11, 12, 13, 13, 14, 15]) if rng.random() < 0.3 else rng.randint(10, 12) for _ in range(k)]
        sched.update(batch, StepOutput([[t] for t in toks], [[0.0]] * k))
    else:
        pytest.fail(f"seed {seed}: workload did not drain")
    bm = sched.block_manager
    assert not sched.waiting and not sched.running and not sched.swapped and not sched.has_unfinished
    assert sched.preemptor.swap_pool.num_free_blocks == sched.preemptor.swap_pool.num_blocks
    assert bm.ref_counts == [0] * num_blocks and sorted(bm.free_block_ids) == list(range(num_blocks))
    for seq in seqs:
        assert seq.status.is_finished and seq.block_ids == []
        stop = _first_stop(seq, max_len)
        if seq.status == St.FINISHED_ABORTED:
            assert stop is None  # nothing had ended it before the abort
        else:
            assert stop == (seq.num_output_tokens - 1, seq.status), seq


@pytest.mark.parametrize("chunk", range(5))
def test_random_workloads_leave_the_books_clean(chunk: int) -> None:
    """Seeded random workloads with random aborts: at every step the ref counts, free list
    and cache agree with the block tables, shared blocks are cached prefix blocks, the KV of
    every computed token is right; at the end every request finished as the oracle says
    and every block is free."""
    for seed in range(chunk * 200, (chunk + 1) * 200):
        _random_workload(seed)


def test_a_flood_of_prompts_never_starves_running_decodes() -> None:
    """Colocated: three requests decode while a long prompt that arrived before them (a
    preempted one resumes with its place in line) prefills, and two more long prompts arrive
    every step. Prefill chunks fill the budget, yet every running decode gets its token in
    every step (the starvation guard: decodes are scheduled before any prefill chunk)."""
    sched = _sched(num_kv_blocks=4096, block_size=4, max_num_batched_tokens=64, max_num_seqs=64,
                   enable_chunked_prefill=True)
    decoders = [_add(sched, f"d{i}", 3) for i in range(3)]
    _step(sched)
    assert all(d.num_output_tokens == 1 for d in decoders)
    older = _add(sched, "older-long", 400, arrival=-1)  # first in line by arrival
    for step in range(40):
        for j in range(2):
            _add(sched, f"flood-{step}-{j}", 200)
        before = {d.request_id: d.num_output_tokens for d in decoders}
        entries = _step(sched)
        assert sum(n for _, n, _ in entries) == 64, "the budget is full every step"
        assert [e for e in entries if e[0] in before] == [(rid, 1, True) for rid in before], (step, entries)
        assert all(d.num_output_tokens == before[d.request_id] + 1 for d in decoders)
    assert older.num_output_tokens > 1, "the older prompt had the rest of the budget first, and decodes too"
