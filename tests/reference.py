"""Reference outputs from transformers, and prompts built from real English text."""

from __future__ import annotations

import argparse
import collections
import json
import logging
import subprocess
import unittest

import torch

# Real text available offline: documentation of standard-library modules.
_TEXT_SOURCES = (argparse, collections, json, logging, subprocess, unittest)


def english_token_ids(tokenizer, num_tokens: int, skip: int = 0) -> list[int]:
    """``num_tokens`` token ids of real English text, starting ``skip`` tokens in."""
    text = "\n\n".join(m.__doc__ or "" for m in _TEXT_SOURCES)
    ids = tokenizer.encode(text)
    assert len(ids) >= skip + num_tokens, "not enough reference text"
    return ids[skip:skip + num_tokens]


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: tuple[int, ...]) -> list[int]:
    """transformers' greedy continuation of one prompt (unbatched: no padding effects)."""
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=list(eos_token_ids), pad_token_id=eos_token_ids[0],
        )
    return out[0, len(prompt_ids):].tolist()


def hf_beam_search(hf_model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: tuple[int, ...],
                   beam_width: int, length_penalty: float, num_return: int) -> list[list[int]]:
    """transformers' beam search (early_stopping=False, its default): the num_return best
    continuations, each cut after its end token (transformers pads the shorter ones)."""
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            do_sample=False, num_beams=beam_width, length_penalty=length_penalty, early_stopping=False,
            num_return_sequences=num_return, eos_token_id=list(eos_token_ids), pad_token_id=eos_token_ids[0],
        )
    results = []
    for row in out[:, len(prompt_ids):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos_token_ids), len(row) - 1)
        results.append(row[:end + 1])
    return results
