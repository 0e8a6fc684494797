"""Greedy parity with transformers on the device: tandem's engine and transformers' own
``generate``, both in float32 on the same GPU, on a few chat prompts. bfloat16 is not
token-exact with anything (rounding differs with every kernel), so parity runs in float32."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tandem.bench.gpu.setup import GpuSetup
from tandem.kernels.ops import BACKEND_ENV
from tandem.llm import LLM
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Explain in two sentences what a GPU is.",
)


def check(setup: GpuSetup, num_tokens: int) -> dict:
    """Each prompt's greedy tokens from both, compared up to EOS or ``num_tokens``. When they
    differ, tandem runs again with the torch attention instead of the Triton kernels, to tell
    whether the kernels (float32 tl.dot may round like TF32) or the rest of the device path
    made the difference."""
    eos = set(setup.config.eos_token_ids)
    prompts = _prompt_ids(setup)
    theirs = [strip_eos(t, eos) for t in transformers_greedy(setup, prompts, num_tokens)]
    ours = [strip_eos(t, eos) for t in _tandem(setup, prompts, num_tokens)]
    diverged = [first_difference(a, b) for a, b in zip(ours, theirs)]
    exact = all(d is None for d in diverged)
    result: dict[str, Any] = {"num_prompts": len(prompts), "num_tokens": num_tokens, "dtype": "float32",
              "num_exact": sum(d is None for d in diverged), "exact": exact, "first_difference": diverged,
              "tandem": ours, "transformers": theirs, "diagnosis": None}
    if not exact:
        with _backend("torch"):
            torch_ours = [strip_eos(t, eos) for t in _tandem(setup, prompts, num_tokens)]
        if torch_ours == theirs:
            result["diagnosis"] = "exact with the torch attention: the Triton kernels' rounding differs"
        else:
            result["diagnosis"] = "differs with the torch attention too: the device path itself"
        logger.warning("greedy parity failed on %d of %d prompts: %s", len(prompts) - result["num_exact"],
                       len(prompts), result["diagnosis"])
    return result


def release(setup: GpuSetup) -> None:
    """Move transformers' model back to the host and free what parity left on the device."""
    setup.hf_model.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()


def _prompt_ids(setup: GpuSetup) -> list[list[int]]:
    tokenizer = setup.tokenizer
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                           add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False) for p in PROMPTS]


def _tandem(setup: GpuSetup, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    llm = LLM.from_loaded(setup.loaded32, device=str(setup.device), dtype="float32", max_num_seqs=len(prompts))
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_tokens))
        return [list(o.token_ids) for o in outputs]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def transformers_greedy(setup: GpuSetup, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """One prompt at a time (no padding to differ by), greedy, stopping at EOS as tandem does."""
    model = setup.hf_model.to(setup.device)
    eos = list(setup.config.eos_token_ids)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids], device=setup.device)
            generated = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                       do_sample=False, max_new_tokens=num_tokens, eos_token_id=eos,
                                       pad_token_id=eos[0])
            out.append(generated[0, len(ids):].tolist())
    return out


def strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Up to the first EOS, without it (one side may include the stop token, the other not)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two differ (a length difference counts), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@contextmanager
def _backend(name: str) -> Iterator[None]:
    """TANDEM_ATTENTION_BACKEND set to ``name`` for the block (ops reads it at every call)."""
    before = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = before
