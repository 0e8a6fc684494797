"""Attention kernels over the paged KV cache: torch references, dispatched in one place."""
