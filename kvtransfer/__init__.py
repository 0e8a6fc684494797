"""Moving paged KV blocks between workers over ZMQ and NCCL (docs/kv-transfer.md; the wire rules: docs/design.md)."""
