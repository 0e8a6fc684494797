"""The checked-in generated code is in step with proto/generation.proto and imports as a package."""

from __future__ import annotations

import subprocess
import sys


def test_generated_code_is_current():
    result = subprocess.run([sys.executable, "-m", "tandem.proto.generate", "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_grpc_module_imports_the_messages_from_the_package():
    from tandem.proto import generation_pb2, generation_pb2_grpc

    # Not a bare `import generation_pb2`, which only works with proto/ on sys.path.
    with open(generation_pb2_grpc.__file__, encoding="utf-8") as f:
        assert "from tandem.proto import generation_pb2 as" in f.read()
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "tandem.v1.Generation"
    assert {m.name: (m.server_streaming, m.client_streaming) for m in service.methods} == {
        "Generate": (True, False), "Abort": (False, False)}


def test_sampling_scalars_have_presence():
    # proto3 `optional`: unset must differ from zero (temperature 0 is greedy, not "default").
    from tandem.proto import generation_pb2 as pb

    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "logprobs",
                 "n", "use_beam_search", "beam_width", "length_penalty"):
        assert pb.SamplingParams.DESCRIPTOR.fields_by_name[name].has_presence, name
