"""Ways of choosing tokens beyond one sample per step: beam search and its stepper, and
speculative decoding (n-gram proposer, draft verification)."""
