"""What one engine runs with, frozen once built: every derived value (pool size, limits) is
worked out by EngineConfig.build before construction. Torch-free, like model_config.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.config.engine_options import ENGINE_DEFAULTS as DEFAULTS
from tandem.config.engine_options import SCHEDULING_POLICIES
from tandem.config.model_config import ModelConfig, gib_to_bytes
from tandem.config.names import (
    ACTIVATION_QUANTIZATIONS,
    DTYPE_BYTES,
    PREEMPTION_MODES,
    QUANTIZATION_CHOICES,
    require,
    resolve_kv_cache_dtype,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """What one engine (a pool worker, or the colocated engine) runs with.

    Build it with :meth:`build`, which derives the pool size and the limits.
    """

    model: ModelConfig
    device_name: str
    """Where every tensor of the engine lives: cpu, cuda or cuda:N (resolved: never auto)."""
    dtype_name: str
    """The dtype of weights and activations, by name (a key of DTYPE_BYTES; resolved: never auto)."""
    kv_cache_dtype_name: str
    """The KV cache's dtype, by name (a key of DTYPE_BYTES; resolved: never auto): what the pool,
    its swap space and its transfers hold, and what its blocks are sized by. K and V are cast
    to it as they are stored and read back in dtype_name's for attention."""
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    """Longest sequence (prompt + output); never more than the pool holds."""
    max_num_seqs: int
    max_num_batched_tokens: int
    """Token budget of one step; without chunked prefill at least max_model_len."""
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    """Tokens a prompt being chunked takes first in a step, before waiting prompts that fit whole
    (then what they leave): see tandem/engine/prefill_policy.py. No cap without chunked prefill."""
    num_swap_blocks: int
    """Host blocks that preempted sequences may swap their KV into (0: never swap)."""
    preemption_mode: str
    """auto (swap or recompute, by the sequence's size), swap (when the host pool has room) or recompute."""
    num_speculative_tokens: int
    """Draft tokens proposed by prompt lookup per decode step, verified in one forward (0: off)."""
    prompt_lookup_max: int
    """Longest n-gram matched against the sequence's earlier tokens to find drafts."""
    prompt_lookup_min: int
    """Shortest n-gram tried before giving up on drafts for a step."""
    quantization: str | None
    """Weight-only quantization of the projections and LM head, done at start or kept from the
    file (None: the weights as loaded; int8, int4). Resolved: never auto or none."""
    tensor_parallel_size: int
    """Ranks the model is split over (each holds its heads' KV: the pool sizes are per rank)."""
    seed: int | None = None
    """The engine's random numbers start from it (unseeded requests repeat across restarts); None: unseeded."""
    scheduling_policy: str = "fcfs"
    """The order requests are served in: fcfs or priority (tandem/engine/waiting_queue.py)."""
    reserve_whole_prompts: bool = False
    """A prompt is admitted only when blocks for all of it are free, and takes them all at
    admission, so a prompt being prefilled never needs another block and nothing is ever
    preempted. A prefill worker's: KV transfers read its blocks while later chunks compute,
    and a preemption would free (or, resumed, resend) them under the transfer."""
    enforce_eager: bool = False
    """Every step runs op by op: no CUDA graphs on CUDA (tandem/engine/cuda_graphs.py), no
    compiled decode step on the CPU (tandem/model/compiled_step.py)."""
    max_cudagraph_capture_size: int = 512
    """The largest decode batch captured as a CUDA graph (vLLM's name and default); larger
    batches run eagerly. Only the buckets up to max_num_seqs' are captured."""
    kv_offload_host_bytes: int = 0
    """The host tier's capacity for evicted prefix blocks of an accelerator's pool (0: none;
    tandem/kvcache/host_tier.py)."""
    kv_offload_disk_bytes: int = 0
    """The disk tier's capacity for evicted prefix blocks (0: none; tandem/kvcache/disk_tier.py)."""
    kv_offload_dir: str | None = None
    """The disk tier's folder (resolved when kv_offload_disk_bytes > 0, else None)."""
    activation_quantization: str = "none"
    """Whether quantized weights' products on the CPU round their activations to 8 bits per
    group of 32 (int8, needing AVX-512 VNNI on the engine's CPU) or not (none); see
    names.ACTIVATION_QUANTIZATIONS and kernels/int4_gemv_cpu.py."""

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of dtype_name, for the engine's tensors. torch is imported here,
        by whoever asks for tensors' dtype, never by importing this module."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def device(self) -> torch.device:
        """The torch device of device_name (torch imported here, as for :attr:`dtype`)."""
        import torch

        return torch.device(self.device_name)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the weights and activations."""
        return DTYPE_BYTES[self.dtype_name]

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The torch dtype of kv_cache_dtype_name (torch imported here, as for :attr:`dtype`)."""
        import torch

        return getattr(torch, self.kv_cache_dtype_name)

    @property
    def kv_cache_dtype_bytes(self) -> int:
        """Bytes per element of the KV cache."""
        return DTYPE_BYTES[self.kv_cache_dtype_name]

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        *,
        device: str = DEFAULTS["device"],
        dtype: str = DEFAULTS["dtype"],
        kv_cache_dtype: str = DEFAULTS["kv_cache_dtype"],
        block_size: int = DEFAULTS["block_size"],
        kv_cache_memory_gib: float = DEFAULTS["kv_cache_memory_gib"],
        num_kv_blocks: int | None = None,
        max_model_len: int | None = DEFAULTS["max_model_len"],
        max_num_seqs: int = DEFAULTS["max_num_seqs"],
        max_num_batched_tokens: int = DEFAULTS["max_num_batched_tokens"],
        enable_prefix_caching: bool = DEFAULTS["enable_prefix_caching"],
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int | None = None,
        swap_space_gib: float = DEFAULTS["swap_space_gib"],
        num_swap_blocks: int | None = None,
        preemption_mode: str = DEFAULTS["preemption_mode"],
        num_speculative_tokens: int = DEFAULTS["num_speculative_tokens"],
        prompt_lookup_max: int = 4,
        prompt_lookup_min: int = 2,
        quantization: str | None = DEFAULTS["quantization"],
        tensor_parallel_size: int = DEFAULTS["tensor_parallel_size"],
        seed: int | None = DEFAULTS["seed"],
        scheduling_policy: str = DEFAULTS["scheduling_policy"],
        reserve_whole_prompts: bool = False,
        enforce_eager: bool = DEFAULTS["enforce_eager"],
        max_cudagraph_capture_size: int = 512,
        kv_offload_host_gib: float = DEFAULTS["kv_offload_host_gib"],
        kv_offload_disk_gib: float = DEFAULTS["kv_offload_disk_gib"],
        kv_offload_dir: str | None = DEFAULTS["kv_offload_dir"],
        activation_quantization: str = DEFAULTS["activation_quantization"],
    ) -> EngineConfig:
        """The defaults of the engine options are tandem.config.engine_options' (the CLI flags' too).
        device, dtype and kv_cache_dtype may be ``auto`` (resolved here: see tandem/config/device.py and
        names.auto_kv_cache_dtype_name)."""
        from tandem.config.device import resolve_device, resolve_dtype  # torch only where a GPU is asked about

        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        require(block_size >= 1, "block_size", block_size, ">= 1")
        require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, ">= 1")
        require(max_num_batched_tokens >= 1, "max_num_batched_tokens", max_num_batched_tokens, ">= 1")
        require(max_cudagraph_capture_size >= 1, "max_cudagraph_capture_size", max_cudagraph_capture_size, ">= 1")
        require(activation_quantization in ACTIVATION_QUANTIZATIONS, "activation_quantization", activation_quantization,
                f"one of {', '.join(ACTIVATION_QUANTIZATIONS)}")
        require(tensor_parallel_size >= 1, "tensor_parallel_size", tensor_parallel_size, ">= 1")
        require(quantization is None or quantization in QUANTIZATION_CHOICES, "quantization", quantization,
                 f"None or one of {', '.join(QUANTIZATION_CHOICES)}")
        # With no source to look at, auto means the weights as given (engine/setup.py looks first).
        quantization = None if quantization in ("auto", "none") else quantization
        kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, quantization, device.split(":")[0])
        tp = tensor_parallel_size
        # The pool and the swap space are sized by the KV dtype's bytes, not the activations'.
        block_bytes = block_size * model.kv_bytes_per_token(kv_cache_dtype, tp)
        if num_kv_blocks is None:
            require(kv_cache_memory_gib > 0, "kv_cache_memory_gib", kv_cache_memory_gib, "> 0")
            num_kv_blocks = gib_to_bytes(kv_cache_memory_gib) // block_bytes
        require(num_kv_blocks >= 1, "num_kv_blocks", num_kv_blocks, ">= 1 (a bigger kv_cache_memory_gib?)")
        require(preemption_mode in PREEMPTION_MODES, "preemption_mode", preemption_mode,
                 f"one of {', '.join(PREEMPTION_MODES)}")
        if num_swap_blocks is None:
            require(swap_space_gib >= 0, "swap_space_gib", swap_space_gib, ">= 0")
            num_swap_blocks = gib_to_bytes(swap_space_gib) // block_bytes
        require(num_swap_blocks >= 0, "num_swap_blocks", num_swap_blocks, ">= 0")
        require(scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", scheduling_policy,
                 f"one of {', '.join(SCHEDULING_POLICIES)}")
        require(num_speculative_tokens >= 0, "num_speculative_tokens", num_speculative_tokens, ">= 0")
        require(prompt_lookup_min >= 1, "prompt_lookup_min", prompt_lookup_min, ">= 1")
        require(prompt_lookup_max >= prompt_lookup_min, "prompt_lookup_max", prompt_lookup_max,
                 f">= prompt_lookup_min ({prompt_lookup_min})")
        for name, gib in (("kv_offload_host_gib", kv_offload_host_gib), ("kv_offload_disk_gib", kv_offload_disk_gib)):
            require(gib >= 0, name, gib, ">= 0")
            require(gib == 0 or enable_prefix_caching, name, gib,
                    "0 without enable_prefix_caching (offloaded blocks are found by their prefix hashes)")
        require(kv_offload_host_gib == 0 or not device.startswith("cpu"), "kv_offload_host_gib", kv_offload_host_gib,
                "0 on the CPU: the pool is host memory already (give it the memory with kv_cache_memory_gib, "
                "and evictions go to kv_offload_disk_gib)")
        if kv_offload_disk_gib > 0 and kv_offload_dir is None:
            root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
            kv_offload_dir = os.path.join(root, "kv-offload")
        # NOTE: swapped blocks never outnumber the device pool, so more host blocks go unused.
        num_swap_blocks = min(num_swap_blocks, num_kv_blocks)

        limit = model.context_limit(max_model_len)
        asked = model.max_position_embeddings if max_model_len is None else min(model.max_position_embeddings,
                                                                                max_model_len)
        if limit < asked:  # only the sliding window takes it below
            logger.info("max_model_len capped at the sliding window (%d)", model.sliding_window)
        limit = min(limit, num_kv_blocks * block_size)
        if not enable_chunked_prefill:
            # A whole prompt must fit in one step's budget.
            max_num_batched_tokens = max(max_num_batched_tokens, limit)
        # Default: half the budget each for the long prompt being chunked and the short ones.
        threshold = (max(1, max_num_batched_tokens // 2) if long_prefill_token_threshold is None
                     else long_prefill_token_threshold)
        require(threshold >= 1, "long_prefill_token_threshold", threshold, ">= 1")
        return cls(
            model=model,
            device_name=device,
            dtype_name=dtype,
            kv_cache_dtype_name=kv_cache_dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=limit,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=min(threshold, max_num_batched_tokens) if enable_chunked_prefill
            else max_num_batched_tokens,
            num_swap_blocks=num_swap_blocks,
            preemption_mode=preemption_mode,
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=prompt_lookup_max,
            prompt_lookup_min=prompt_lookup_min,
            quantization=quantization,
            tensor_parallel_size=tp,
            seed=seed,
            scheduling_policy=scheduling_policy,
            reserve_whole_prompts=reserve_whole_prompts,
            enforce_eager=enforce_eager,
            max_cudagraph_capture_size=max_cudagraph_capture_size,
            kv_offload_host_bytes=gib_to_bytes(kv_offload_host_gib),
            kv_offload_disk_bytes=gib_to_bytes(kv_offload_disk_gib),
            kv_offload_dir=kv_offload_dir if kv_offload_disk_gib > 0 else None,
            activation_quantization=activation_quantization,
        )
