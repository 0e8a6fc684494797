"""The engine core every pool shares: sequences, the scheduler (policy) and its preemption, the
model runner, the sampler, the detokenizer, and the engine that steps them."""
