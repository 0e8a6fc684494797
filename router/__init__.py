"""The gRPC front door: validation, tokenization, worker choice, streaming (see docs/architecture.md)."""
