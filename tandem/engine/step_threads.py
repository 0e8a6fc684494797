"""How many torch threads a step runs on, by its size.

A served CPU worker shares its cores with its serving path: Ray streams every new token to
the router, which writes it to the client. On a small step (a few sequences decoding) that
work wants a core at the very moments the step does, and a step thread that loses its core
stalls every parallel region of the step behind it (measured on 2 cores: a lone stream's
token took 22 ms on 2 threads, 14 ms on 1; the step alone takes 10 ms on 2). A large step
(prefill chunks, many sequences) is long enough to pay for every thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SMALL_STEP_TOKENS = 4
"""Steps of at most this many tokens leave a core to the serving path (measured on 2 cores:
a decode of 4 streams is faster on 1 thread, one of 8 on 2)."""


@dataclass(frozen=True)
class StepThreads:
    """Torch threads per step: ``num_threads``, or ``num_small_step_threads`` for a step of
    at most ``max_small_step_tokens`` tokens."""

    num_threads: int
    num_small_step_threads: int
    max_small_step_tokens: int = MAX_SMALL_STEP_TOKENS

    @classmethod
    def for_served_worker(cls, num_threads: int) -> StepThreads | None:
        """A worker's policy: one core fewer on small steps (None on a single thread: then
        the serving path has the other cores already, or none to take)."""
        if num_threads < 2:
            return None
        return cls(num_threads, num_threads - 1)

    def for_step(self, num_tokens: int) -> int:
        return self.num_small_step_threads if num_tokens <= self.max_small_step_tokens else self.num_threads

    def apply(self, num_tokens: int) -> None:
        """Set this thread's torch threads for a step of ``num_tokens`` (a no-op when unchanged)."""
        wanted = self.for_step(num_tokens)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
