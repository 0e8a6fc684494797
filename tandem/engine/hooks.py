"""What a prefill worker runs inside the engine's step: it sends a prompt's KV layer by layer
as the forward stores it, so that the transfer overlaps the rest of the prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tandem.engine.scheduler import ScheduledBatch
from tandem.outputs import RequestDelta


@dataclass(frozen=True)
class PrefillHooks:
    """Given to LLMEngine once, at construction, by a prefill worker; the decode and
    colocated workers give none.

    NOTE: each runs on the thread that steps the engine, inside the step: it must not call
    the engine back (no add_request, no abort_request).
    """

    on_layer_stored: Callable[[ScheduledBatch, int], None]
    """(batch, layer): the step's KV of ``layer`` is in the cache (see LlamaModel.forward)."""
    on_delta: Callable[[RequestDelta], None]
    """Sees each of the step's deltas at the step's end, in order (a prompt's first sample:
    LLMEngine.first_sample reads the generators' states then)."""
    send_plan: Callable[[ScheduledBatch], np.ndarray] | None = None
    """(batch) -> the cache slots whose KV on_layer_stored sends, in its order, asked before
    the forward. Only a tensor-parallel runner needs them: its first rank gathers their rows
    from every rank (see ModelRunner.run)."""
