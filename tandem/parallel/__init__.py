"""Tensor parallelism inside one worker: which part each rank holds, the rank actors, and the step
message rank 0 sends them (see docs/tensor-parallelism.md)."""
