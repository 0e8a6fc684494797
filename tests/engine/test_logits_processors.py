"""Penalties, logit_bias and min_tokens (tandem/engine/logits_processors.py), against independent
references: transformers' own repetition penalty and min_new_tokens in its generate(), and a
float64 greedy loop over transformers' logits for OpenAI's frequency and presence penalties and
logit_bias. The log-probabilities reported stay the model's own (before any of it)."""

from __future__ import annotations

import pytest
import torch
from reference import english_token_ids

from tandem import SamplingParams
from tandem.engine.logits_processors import apply_logits_processors
from tandem.engine.sequence import Sequence

STEPS = 12


def hf_generate(hf_model, prompt: list[int], **kwargs) -> list[int]:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=STEPS, **kwargs)
    return out[0, len(prompt):].tolist()


def float64_greedy(hf_model, prompt: list[int], frequency: float, presence: float, bias: dict[int, float]) -> list[int]:
    """OpenAI's rule, step by step: logit - frequency * count - presence * (count > 0) + bias."""
    ids = list(prompt)
    for _ in range(STEPS):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=logits.numel()).double()
        logits = logits - frequency * counts - presence * (counts > 0).double()
        for token, b in bias.items():
            logits[token] += b
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    # Repetitive text, where the penalties change the greedy choice.
    return [english_token_ids(tokenizer, 24), tokenizer.encode("one two three one two three one two three one two")]


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_is_transformers(make_llm, hf_model, prompts, penalty):
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, repetition_penalty=penalty)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    expected = [hf_generate(hf_model, p, repetition_penalty=penalty, eos_token_id=None) for p in prompts]
    assert got == expected
    assert got != [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS,
                                                                              ignore_eos=True))]


@pytest.mark.parametrize(("frequency", "presence", "bias"), [(1.5, 0.0, {}), (0.0, 2.0, {}), (0.5, 0.5, {}),
                                                             (0.0, 0.0, {11: 30.0}), (-1.0, 0.0, {})])
def test_frequency_presence_and_bias_are_openais_rule(make_llm, hf_model, prompts, frequency, presence, bias):
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, frequency_penalty=frequency,
                            presence_penalty=presence, logit_bias=bias)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [float64_greedy(hf_model, p, frequency, presence, bias) for p in prompts]


def test_min_tokens_is_transformers_min_new_tokens(make_llm, hf_model):
    """A prompt whose greedy answer ends early (8 tokens, "2 + 2 = 4"): with min_tokens the EOS waits."""
    llm = make_llm()
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with a number only."}])
    eos = list(llm.config.model.eos_token_ids)
    short = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=STEPS))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 10
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=10))[0].token_ids
    expected = hf_generate(hf_model, prompt, min_new_tokens=10, eos_token_id=eos, pad_token_id=eos[0])
    assert got == expected and len(got) >= 10
    assert not set(got[:10]) & set(eos)


def test_logprobs_stay_the_models_own(make_llm, hf_model, prompts):
    """A bias that forces a token: the token comes, its logprob is the raw model's."""
    llm = make_llm()
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=1, logit_bias={11: 100.0},
                                                  logprobs=True))[0]
    assert out.token_ids == [11]
    with torch.inference_mode():
        raw = torch.log_softmax(hf_model(torch.tensor([prompts[0]])).logits[0, -1].double(), dim=-1)[11]
    assert out.logprobs[0] == pytest.approx(float(raw), abs=1e-3)


def test_top_logprobs_follow_transformers_step_by_step(make_llm, hf_model, prompts):
    """Top 5 at every position of a sampled, penalised completion (n = 2, so the second
    completion forks the first's blocks): the model's own distribution after the tokens
    that came, from transformers' forward in float64; the chosen token's logprob is there
    whenever it is among them."""
    llm = make_llm()
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True, logprobs=5, n=2,
                            repetition_penalty=1.3)
    out = llm.generate(prompts[1], params)[0]
    for completion in out.outputs:
        tokens = prompts[1] + completion.token_ids
        with torch.inference_mode():
            logits = hf_model(torch.tensor([tokens])).logits[0].double()
        reference = torch.log_softmax(logits[len(prompts[1]) - 1:-1], dim=-1).topk(5)
        assert len(completion.top_logprobs) == len(completion.token_ids) == 6
        for j, top in enumerate(completion.top_logprobs):
            assert top.token_ids == reference.indices[j].tolist()
            assert top.logprobs == pytest.approx(reference.values[j].tolist(), abs=1e-3)
            if completion.token_ids[j] in top.token_ids:
                chosen = top.token_ids.index(completion.token_ids[j])
                assert completion.logprobs[j] == pytest.approx(top.logprobs[chosen], abs=1e-5)


def target(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    """A sequence with this prompt and these output tokens so far: what apply_logits_processors reads."""
    seq = Sequence("target", prompt, params, arrival_index=0)
    seq.token_ids.extend(output)
    return seq


def test_rows_without_processing_are_untouched_and_the_input_is_not_changed():
    logits = torch.randn(2, 50)
    before = logits.clone()
    targets = [target([1, 2], [3, 3], SamplingParams()), target([1, 2], [3, 3], SamplingParams(repetition_penalty=2.0))]
    out = apply_logits_processors(logits, targets, eos_token_ids=[0])
    assert torch.equal(logits, before) and torch.equal(out[0], before[0])
    expected = before[1].double()
    for t in (1, 2, 3):
        expected[t] = expected[t] / 2 if expected[t] > 0 else expected[t] * 2
    assert torch.allclose(out[1].double(), expected)
    assert apply_logits_processors(logits, targets[:1], eos_token_ids=[0]) is logits  # nothing to do: no copy


def reference(logits: torch.Tensor, targets: list[Sequence], eos: list[int]) -> torch.Tensor:
    """The rules from their definitions, one row and one token at a time, in float64: vLLM's
    min_tokens (EOS unless ignore_eos, and stop_token_ids, banned), OpenAI's logit_bias,
    transformers' repetition penalty over prompt and output, OpenAI's frequency and presence."""
    out = logits.double().clone()
    vocab = out.shape[1]
    for row, t in zip(out, targets):
        p = t.params
        if t.num_output_tokens < p.min_tokens:
            for token in [*p.stop_token_ids, *([] if p.ignore_eos else eos)]:
                if token < vocab:
                    row[token] = float("-inf")
        for token, b in p.logit_bias:
            if token < vocab:
                row[token] += b
        for token in set(t.token_ids):
            x = row[token].item()
            row[token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in set(t.output_token_ids):
            n = t.output_token_ids.count(token)
            row[token] -= p.frequency_penalty * n + p.presence_penalty
    return out


def test_dense_processing_is_the_definitions_in_float64():
    """Every rule, alone and together, on one batch (rows that ask for nothing among them):
    the dense float32 result within float32 rounding of the float64 reference, -inf where it bans."""
    vocab, eos = 1000, [2, 999]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, vocab, generator=gen) * 4
    prompt, output = [5, 9, 9, 40, 700, 3], [9, 12, 12, 12, 700, 2, 41]
    targets = [
        target(prompt, output, SamplingParams()),
        target(prompt, output, SamplingParams(repetition_penalty=1.7)),
        target(prompt, output, SamplingParams(repetition_penalty=0.6)),
        target(prompt, output, SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4)),
        target(prompt, output, SamplingParams(logit_bias={12: 5.0, 0: -30.0, 1500: 3.0})),
        target(prompt, output, SamplingParams(min_tokens=12, stop_token_ids=(7, 2000))),
        target(prompt, output, SamplingParams(min_tokens=12, ignore_eos=True, stop_token_ids=(8,))),
        target(prompt, output, SamplingParams(min_tokens=3, stop_token_ids=(7,))),  # past min_tokens: no ban
        target(prompt, [], SamplingParams(repetition_penalty=1.3, frequency_penalty=1.1, presence_penalty=0.5,
                                          logit_bias={9: 2.5}, min_tokens=1)),
    ]
    got = apply_logits_processors(logits, targets, eos_token_ids=eos)
    expected = reference(logits, targets, eos)
    assert got.dtype == torch.float32 and torch.equal(got[0], logits[0])
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert int(torch.isinf(got).sum()) == 3 + 1 + 2  # EOS twice and 7; 8 alone; EOS twice
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-5, equal_nan=False)
    assert not torch.allclose(got[1:], logits[1:])  # (each processed row changed)


def test_processing_depends_on_the_row_alone():
    """A row's result is the same alone or in a batch of others with wider token lists."""
    vocab = 300
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    row = target([1, 2, 3], [4, 4, 5], SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3))
    others = [target(list(range(100)), list(range(50, 90)), SamplingParams(presence_penalty=1.0)),
              target([7], [], SamplingParams(logit_bias={3: 1.0}))]
    alone = apply_logits_processors(logits[1:2], [row], eos_token_ids=[0])
    batched = apply_logits_processors(logits, [others[0], row, others[1]], eos_token_ids=[0])
    assert torch.equal(alone[0], batched[1])
