"""Kernels over the paged KV cache (attention, the KV store) and weight-only GEMVs: each Triton kernel beside
its torch reference, dispatched in one place (ops.py; see docs/kernels.md)."""
