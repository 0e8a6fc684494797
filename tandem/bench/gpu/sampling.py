"""The sampling step on a real GPU: what the fake-CUDA tests prove about where tensors live,
checked for behaviour on the device itself.

- The counter-based random bits (device_random) are the same on the CPU and on CUDA, and the
  exponential draws made from them (CUDA's ``log1p`` may round differently: counted, not failed).
- Seeded sampling with penalties, ``logit_bias``, ``min_tokens``, n=2 and top log-probabilities
  gives the same tokens in two fresh engines on the device.
- Speculative decoding (prompt lookup, 4 drafts) gives plain greedy's tokens on the device.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from tandem.bench.gpu.setup import GpuSetup
from tandem.engine import device_random
from tandem.llm import LLM
from tandem.sampling_params import SamplingParams

PROMPTS = ("Write a short poem about the sea.", "List five fruits, one per line, twice.", "What is 2+2? Explain.")
NUM_TOKENS = 48


def _tokens(setup: GpuSetup, params: SamplingParams, **engine_args: Any) -> list[list[list[int]]]:
    """Each prompt's completions' tokens from a fresh float32 engine on the device."""
    llm = LLM.from_loaded(setup.loaded32, device=str(setup.device), dtype="float32", **engine_args)
    try:
        return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(list(PROMPTS), params)]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def check(setup: GpuSetup) -> list[str]:
    """-> a PASS or FAIL line per check (and how the exponentials compare, as a figure)."""
    lines = []
    keys = torch.tensor([device_random.draw_key(s, p) for s in (0, 7, 2**40) for p in (0, 1, 999)])
    bits_equal = torch.equal(device_random.uniforms(keys, 4096),
                             device_random.uniforms(keys.to(setup.device), 4096).cpu())
    host = device_random.exponentials(keys, setup.config.vocab_size)
    on_device = device_random.exponentials(keys.to(setup.device), setup.config.vocab_size).cpu()
    differ = int((host != on_device).sum())
    ulps = int((host.view(torch.int32) - on_device.view(torch.int32)).abs().max())
    lines.append(f"{'PASS' if bits_equal else 'FAIL'} sampling: the counter-based random bits are the same on the "
                 f"CPU and on CUDA; the exponential draws differ in {differ} of {host.numel()} entries "
                 f"(at most {ulps} ulp: log1p's rounding)")
    mixed = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, repetition_penalty=1.2,
                           frequency_penalty=0.5, presence_penalty=0.3, logit_bias=((11, -5.0),), min_tokens=5, n=2,
                           logprobs=3, max_tokens=NUM_TOKENS)
    first, second = _tokens(setup, mixed), _tokens(setup, mixed)
    num_tokens = sum(len(t) for prompt in first for t in prompt)
    lines.append(f"{'PASS' if first == second else 'FAIL'} sampling: seeded n=2 with penalties, logit_bias, "
                 f"min_tokens and top logprobs repeats in a fresh engine on the device ({num_tokens} tokens)")
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    plain, drafted = _tokens(setup, greedy), _tokens(setup, greedy, num_speculative_tokens=4)
    lines.append(f"{'PASS' if plain == drafted else 'FAIL'} sampling: speculative decoding (4 drafts) gives plain "
                 f"greedy's tokens on the device")
    return lines
