"""Moving paged KV blocks between workers over ZMQ and NCCL (see DESIGN.md)."""
