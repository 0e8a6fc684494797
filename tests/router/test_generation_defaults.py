"""--generation-config (vLLM's): the sampling defaults a model's generation_config.json gives
reach requests that leave those fields unset, through both APIs; `vllm` turns them off."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tandem.model.generation_defaults import sampling_defaults
from tandem.proto import generation_pb2 as pb
from tandem.router import serve_command
from tandem.router.limits import RequestLimits
from tandem.router.openai.protocol import CHAT, parse_request
from tandem.router.openai.validated import validated_all
from tandem.router.tokenizer import RouterTokenizer
from tandem.router.validation import validate_request
from tandem.worker.tokenizer_spec import tokenizer_spec_from

GIVEN = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
         "max_new_tokens": 64, "bos_token_id": 1, "eos_token_id": [2, 3]}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 64}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(GIVEN))
    return tmp_path


def test_the_defaults_are_vllms_keys_of_the_file(model_dir, tmp_path_factory):
    assert sampling_defaults(str(model_dir)) == DEFAULTS
    assert sampling_defaults(str(model_dir), "vllm") == {}
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    assert sampling_defaults(str(elsewhere)) == {}  # auto, and the model has none
    assert sampling_defaults(str(elsewhere), str(model_dir)) == DEFAULTS
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        sampling_defaults(str(model_dir), str(elsewhere))


def test_unset_fields_take_the_models_defaults(router_tokenizer, tokenizer, model_dir):
    spec = tokenizer_spec_from(tokenizer, "m", router_tokenizer.vocab_size, router_tokenizer.max_model_len,
                               sampling_defaults(str(model_dir)))
    assert spec.sampling_defaults == tuple(sorted(DEFAULTS.items()))
    served = RouterTokenizer.from_spec(spec)
    unset = validate_request(pb.GenerateRequest(prompt="Hi"), served).params
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty, unset.max_tokens) == (
        0.6, 0.9, 20, 1.1, 64)
    chosen = validate_request(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
        temperature=0, max_tokens=5)), served).params
    assert (chosen.temperature, chosen.max_tokens, chosen.top_k) == (0, 5, 20)
    (chat,) = validated_all(parse_request(CHAT, {"messages": [{"role": "user", "content": "Hi"}]}, "m", "r"), served,
                            RequestLimits())
    assert chat.params.max_tokens == 64  # the model's default, not the whole room
    plain = validate_request(pb.GenerateRequest(prompt="Hi"), RouterTokenizer.from_spec(
        dataclasses.replace(spec, sampling_defaults=()))).params
    assert (plain.temperature, plain.top_k) == (1.0, -1)


def test_serve_passes_the_flag_to_every_worker():
    import argparse

    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    assert serve_command.worker_config(parser.parse_args([])).generation_config == "auto"
    assert serve_command.worker_config(parser.parse_args(["--generation-config", "vllm"])).generation_config == "vllm"
