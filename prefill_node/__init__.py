"""The prefill worker (a Ray actor) running the shared engine core (see docs/architecture.md)."""
