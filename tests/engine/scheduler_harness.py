"""A scheduler over a fake one-layer model, and helpers that add requests and run steps
with chosen tokens: the scheduler tests drive it without any forward pass."""

from __future__ import annotations

import itertools

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.sampler import StepOutput
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence
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


def make_scheduler(num_kv_blocks: int = 64, block_size: int = 4, **kw) -> Scheduler:
    cfg = EngineConfig.build(MODEL, num_kv_blocks=num_kv_blocks, block_size=block_size, **kw)
    return Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching))


def add_seq(sched: Scheduler, rid: str, prompt: int | list[int], arrival: int | None = None, **params) -> Sequence:
    if isinstance(prompt, int):  # distinct tokens per request: no accidental prefix hits
        start = 1000 * (1 + next(_prompts))
        prompt = list(range(start, start + prompt))
    params.setdefault("max_tokens", 100)
    seq = Sequence(rid, prompt, SamplingParams(**params), next(_arrivals) if arrival is None else arrival)
    sched.add(seq)
    return seq


def run_step(sched: Scheduler, token: int | dict[str, int] = 7) -> list[tuple[str, int, bool]]:
    """One engine step; returns (request_id, num_new_tokens, samples) per batch entry."""
    batch = sched.schedule()
    entries = [(s.request_id, n, batch.samples(i)) for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))]
    toks = [token if isinstance(token, int) else token[r] for r, _, samples in entries if samples]
    updates = sched.update(batch, StepOutput([[t] for t in toks], [[-0.5] for _ in toks]))
    assert [u.new_token_ids for u in updates] == [[t] for t in toks]
    return entries


def all_free(sched: Scheduler) -> bool:
    bm = sched.block_manager
    return bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
