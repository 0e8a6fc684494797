"""The Triton kernels' launch contract on fake CUDA: they cannot run on fake tensors, so each
kernel launch of a forward is recorded instead, from the same metadata the step builds, and
checked: every tensor on the device, index tensors int64, the operands' dtypes, unit strides
where the kernels assume them, and grids sized from the batch. (Their numbers are checked
against the torch references under the interpreter: tests/kernels.)"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field

import pytest
import torch
from fake_cuda import BATCHES, CUDA, SMOLLM2, runner

from tandem.kernels import (
    int4_gemv_triton,
    int8_gemv_triton,
    ops,
    paged_decode_attention_triton,
    prefill_attention_triton,
    store_kv_triton,
)

KERNELS = {
    "store_kv": (store_kv_triton, "_store_kv_kernel"),
    "paged_decode": (paged_decode_attention_triton, "_paged_decode_kernel"),
    "merge_splits": (paged_decode_attention_triton, "_merge_splits_kernel"),
    "prefill": (prefill_attention_triton, "_prefill_attention_kernel"),
    "int8_gemv": (int8_gemv_triton, "_int8_gemv_kernel"),
    "int4_gemv": (int4_gemv_triton, "_int4_gemv_kernel"),
}


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict = field(default_factory=dict)


class RecordedKernel:
    """Stands in for a @triton.jit function: ``kernel[grid](*args)`` records the launch."""

    def __init__(self, name: str, launches: list[Launch]) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launches.append(Launch(self.name, tuple(grid), args, kwargs))


@pytest.fixture
def launches(fake_cuda, monkeypatch) -> list[Launch]:
    monkeypatch.setenv(ops.BACKEND_ENV, "auto")  # Triton, as on CUDA tensors
    # An H100's 132 SMs: the kernels size their splits from the device.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(int8_gemv_triton, "_num_sms", lambda index: 132)
    recorded: list[Launch] = []
    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, RecordedKernel(name, recorded))
    return recorded


def tensors(launch: Launch) -> list[torch.Tensor]:
    return [a for a in launch.args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_every_launch_is_on_the_device_and_sized_from_the_batch(launches, name: str, quantization: str | None):
    r = runner(quantization)
    batch = BATCHES[name][0]()
    _, _, meta, _ = r.prepare(batch)
    logits = r.forward(batch, None, None)
    assert logits.device == CUDA
    by_kernel: dict[str, list[Launch]] = {}
    for launch in launches:
        by_kernel.setdefault(launch.kernel, []).append(launch)
        assert launch.grid and all(isinstance(g, int) and g >= 1 for g in launch.grid), launch.grid
        assert all(t.device == CUDA for t in tensors(launch)), launch.kernel
        assert all(math.isfinite(a) for a in launch.args if isinstance(a, (int, float))), launch.kernel
    num_layers = SMOLLM2.num_layers
    num_tokens = meta.slot_mapping.shape[0]
    for launch in by_kernel["store_kv"]:
        k, v, k_cache, v_cache, slots = launch.args[:5]
        assert launch.grid == (num_tokens,) and slots.dtype == torch.int64
        assert k.dtype == v.dtype == k_cache.dtype == torch.bfloat16
        assert all(t.stride(-1) == 1 for t in (k, v, k_cache, v_cache))
    assert len(by_kernel["store_kv"]) == num_layers
    decodes, prefills = by_kernel.get("paged_decode", []), by_kernel.get("prefill", [])
    assert len(decodes) == (num_layers if meta.num_decode_tokens else 0)
    assert len(prefills) == (num_layers if meta.num_prefills else 0)
    for launch in decodes:
        q, k_cache, v_cache, tables, lens, out = launch.args[:6]
        assert launch.grid[:2] == (meta.num_decode_tokens, SMOLLM2.num_kv_heads)
        assert tables.dtype == lens.dtype == torch.int64 and tables.shape[0] == lens.shape[0] == q.shape[0]
        assert q.dtype == k_cache.dtype == out.dtype and all(t.stride(-1) == 1 for t in (q, k_cache, v_cache, out))
    for launch in prefills:
        q, k_cache, v_cache, tables, layout, out = launch.args[:6]
        assert launch.grid[1:] == (meta.num_prefills, SMOLLM2.num_heads)
        assert tables.dtype == layout.dtype == torch.int64 and tuple(layout.shape) == (meta.num_prefills, 3)
        assert layout.is_contiguous() and all(t.stride(-1) == 1 for t in (q, k_cache, v_cache, out))
    # The GEMV kernels take decode-sized products (quantization.TRITON_MAX_TOKENS rows): a
    # layer's four at most 16 tokens, the LM head's (int8 under both methods) for the few sampled rows.
    int8, int4 = by_kernel.get("int8_gemv", []), by_kernel.get("int4_gemv", [])
    layers = 4 * num_layers if num_tokens <= 16 else 0
    assert len(int8) == {None: 0, "int8": layers + 1, "int4": 1}[quantization]
    assert len(int4) == (layers if quantization == "int4" else 0)
    for launch, weight_dtype in [(x, torch.int8) for x in int8] + [(x, torch.uint8) for x in int4]:
        x, qweight = launch.args[:2]
        assert x.dtype == torch.bfloat16 and qweight.dtype == weight_dtype and x.stride(-1) == 1
