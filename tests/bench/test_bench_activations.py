"""`tandem bench activations` on the default model, small: float32 activations' perplexity is the
float32 model's own (the int4 blocks are the file's, and the float32 model is that file
dequantized), and 8-bit activations move it a little, not a lot."""

from __future__ import annotations

import argparse
import json

import pytest

from tandem import cli
from tandem.bench import activations
from tandem.kernels import int4_gemv_cpu


@pytest.mark.skipif(not int4_gemv_cpu.has_int8_dot(), reason="8-bit activations need AVX-512 VNNI")
def test_the_rounding_costs_a_little_perplexity(tmp_path, capsys):
    assert cli.parse_args(["bench", "activations"]).bench == "activations"
    args = argparse.Namespace(model=None, max_tokens=4, ppl_tokens=256, num_threads=None, out_dir=str(tmp_path))
    assert activations.run(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    none, int8 = results["rows"]
    assert (none["activation_quantization"], int8["activation_quantization"]) == ("none", "int8")
    assert abs(none["perplexity"] / results["float32_model_perplexity"] - 1) < 0.005
    assert none["perplexity"] != int8["perplexity"] and abs(int8["perplexity"] / none["perplexity"] - 1) < 0.05
    assert none["equal_prefix"] == [4] * 8 and none["identical_share"] == 1.0
    assert "int8 vs none, equal prefix per prompt:" in capsys.readouterr().out
