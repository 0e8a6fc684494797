"""Helpers of `tandem bench quant`: the per-size kernel timings
(`python -m tandem.bench.quantization.kernels`) and the report."""
