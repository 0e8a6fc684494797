"""skip_special_tokens and include_stop_str_in_output (vLLM's): the text against transformers'
decode of the same tokens; an ending EOS is never in the text unless asked for."""

from __future__ import annotations

from tandem import SamplingParams

IM_START = 1  # <|im_start|>, a special token of the default model


def test_special_tokens_are_kept_only_when_asked(make_llm, tokenizer):
    llm = make_llm()
    forced = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={IM_START: 100.0})
    kept = llm.generate("Hi", SamplingParams(skip_special_tokens=False, **forced))[0]
    skipped = llm.generate("Hi", SamplingParams(**forced))[0]
    assert kept.token_ids == skipped.token_ids == [IM_START] * 3
    assert kept.text == tokenizer.decode([IM_START] * 3, skip_special_tokens=False) == "<|im_start|>" * 3
    assert skipped.text == ""


def test_the_stop_string_is_in_the_text_only_when_asked(make_llm):
    llm = make_llm()
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].text
    assert "Paris" in full
    cut = full.index("Paris")
    without = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=["Paris"]))[0]
    with_it = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=["Paris"],
                                                  include_stop_str_in_output=True))[0]
    assert without.text == full[:cut] and with_it.text == full[:cut + len("Paris")]
    assert without.finish_reason == with_it.finish_reason == "stop"


def test_an_ending_eos_shows_only_with_include_stop_str_in_output(make_llm, tokenizer):
    llm = make_llm()
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with a number only."}])
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, skip_special_tokens=False))[0]
    shown = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, skip_special_tokens=False,
                                                include_stop_str_in_output=True))[0]
    assert plain.finish_reason == "stop" and plain.token_ids == shown.token_ids
    eos_text = tokenizer.decode(plain.token_ids[-1:], skip_special_tokens=False)
    assert plain.text == tokenizer.decode(plain.token_ids[:-1], skip_special_tokens=False)
    assert shown.text == plain.text + eos_text and eos_text == "<|im_end|>"
