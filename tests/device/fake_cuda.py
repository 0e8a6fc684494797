"""Fake CUDA on this CPU-only machine, for the tests here: torch's FakeTensorMode makes
tensors on ``cuda`` without a GPU, refuses any operation that mixes them with host tensors and
any host read of a device value; the shims below let it through the Python bindings that a
torch built without CUDA refuses, and DeviceAudit records the device of every tensor an
operation produces."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.cuda_graphs import GraphDevice
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.model.llama import LayerWeights, LlamaModel, ModelWeights
from tandem.model.quantization import quantize_weights
from tandem.sampling_params import SamplingParams

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
SMOLLM2 = ModelConfig(  # the default model's shapes (SmolLM2-135M)
    name="smollm2-shape", architecture="LlamaForCausalLM", num_layers=30, hidden_size=576,
    intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
    attention_bias=False, tie_word_embeddings=True, max_position_embeddings=8192, sliding_window=None,
    eos_token_ids=(2,),
)
def fake_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """step_inputs.to_device under FakeTensorMode, where torch without CUDA cannot copy to
    cuda: a tensor of the same shape on the device (noted by the audit running, if any)."""
    if device.type == "cpu":
        return host
    if DeviceAudit.current is not None:
        DeviceAudit.current.transfers.append(len(DeviceAudit.current.outputs))
    return torch.empty(host.shape, dtype=host.dtype, device=device)


def fake_to_host(t: torch.Tensor) -> torch.Tensor:
    """step_inputs.to_host under FakeTensorMode (see fake_to_device)."""
    return t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype)


def _basic_index(t: torch.Tensor, index) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
    """Python indexing as aten ops: ``t`` after the ints, slices, None and Ellipsis of
    ``index``, and the tensor indices left for aten.index (None: there are none)."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in [i for i in index if not isinstance(i, torch.Tensor)]:
        k = next(n for n, i in enumerate(index) if i is Ellipsis)
        specified = sum(i is not None and i is not Ellipsis for i in index)
        index = index[:k] + (slice(None),) * (t.dim() - specified) + index[k + 1:]
    dim, tensors = 0, {}
    for i in index:
        if i is None:
            t, dim = t.unsqueeze(dim), dim + 1
        elif isinstance(i, int) and not isinstance(i, bool):
            t = t.select(dim, i)
        elif isinstance(i, slice):
            t, dim = aten.slice.Tensor(t, dim, i.start, i.stop, 1 if i.step is None else i.step), dim + 1
        elif isinstance(i, torch.Tensor):
            tensors[dim], dim = i, dim + 1
        else:
            raise NotImplementedError(f"index {i!r} in the fake-cuda indexing shim")
    return t, [tensors.get(d) for d in range(max(tensors) + 1)] if tensors else None


def _on_fake_cuda(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor) and t.device.type == "cuda"


@contextlib.contextmanager
def fake_cuda_bindings() -> Iterator[None]:
    """Tensor indexing, copy_ and contiguous on fake cuda tensors, through their aten ops.

    NOTE: why. Their Python bindings take a CUDA device guard before dispatch, which a torch
    built without CUDA refuses ("not linked with support for cuda devices") even for fake
    tensors; the aten ops below them run under FakeTensorMode, which still refuses any op
    that mixes devices and any host read. copy_ keeps refusing to cross devices: crossing
    goes through step_inputs.to_device alone."""
    get, set_, copy, contiguous = (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_,
                                   torch.Tensor.contiguous)  # the bindings, called where the shim does not apply

    def getitem(self: torch.Tensor, index):
        if not _on_fake_cuda(self):
            return get(self, index)
        t, tensors = _basic_index(self, index)
        return t if tensors is None else aten.index.Tensor(t, tensors)

    def setitem(self: torch.Tensor, index, value) -> None:
        if not _on_fake_cuda(self):
            return set_(self, index, value)
        t, tensors = _basic_index(self, index)
        if not isinstance(value, torch.Tensor):
            value = torch.full((), value, dtype=self.dtype, device=self.device)
        if tensors is None:
            copy_(t, value)
        else:
            aten.index_put_.default(t, tensors, value)

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if not _on_fake_cuda(self):
            return copy(self, src, non_blocking)
        if src.device != self.device:
            raise RuntimeError(f"copy_ from {src.device} to {self.device} inside the step")
        return aten.copy_.default(self, src, non_blocking)

    def contiguous_(self: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        if not _on_fake_cuda(self) or self.is_contiguous(memory_format=memory_format):
            return contiguous(self, memory_format=memory_format)
        return aten.clone.default(self, memory_format=memory_format)

    patched = dict(__getitem__=getitem, __setitem__=setitem, copy_=copy_, contiguous=contiguous_)
    originals = {name: getattr(torch.Tensor, name) for name in patched}
    for name, f in patched.items():
        setattr(torch.Tensor, name, f)
    try:
        yield
    finally:
        for name, f in originals.items():
            setattr(torch.Tensor, name, f)


class DeviceAudit(TorchDispatchMode):
    """Every op that produces a tensor, with that tensor's device, and where the step's
    transfers to the device came (see fake_to_device)."""

    current: DeviceAudit | None = None

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, torch.device]] = []
        self.transfers: list[int] = []
        """Positions in outputs at which a tensor went to the device."""

    def __enter__(self) -> DeviceAudit:
        DeviceAudit.current = self
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        DeviceAudit.current = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.outputs += [(str(func), t.device) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def off_device_after_transfer(self) -> list[str]:
        """The ops that made a tensor off the device once the step's inputs went there (the
        host builds them before: the message)."""
        assert self.transfers, "nothing went to the device"
        return [op for op, device in self.outputs[self.transfers[0]:] if device != CUDA]


def random_weights(cfg: ModelConfig, dtype: torch.dtype) -> ModelWeights:
    """Weights of cfg's shapes on the (fake) device: only shapes matter here."""
    rand = lambda *shape: torch.randn(*shape, dtype=dtype, device=CUDA)  # noqa: E731
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    layers = [LayerWeights(rand(q + 2 * kv, h), None, rand(h, q), rand(2 * cfg.intermediate_size, h),
                           rand(h, cfg.intermediate_size), rand(h), rand(h)) for _ in range(cfg.num_layers)]
    embed = rand(cfg.vocab_size, h)
    inv_freq = torch.rand(cfg.head_dim // 2, dtype=torch.float32, device=CUDA)
    return ModelWeights(embed, layers, rand(h), embed, inv_freq, 1.0)


BLOCK_SIZE = 16
NUM_BLOCKS = 64


def runner(quantization: str | None = None, graph_device: GraphDevice | None = None,
           max_num_seqs: int = 64) -> ModelRunner:
    """An engine's runner on fake cuda (its config built as cpu: this machine has no GPU to
    resolve cuda on), padding decode batches as it does on CUDA; eager unless ``graph_device``
    stands in for CUDA graphs (torch's own cannot capture fake tensors)."""
    config = EngineConfig.build(SMOLLM2, device="cpu", dtype="bfloat16", block_size=BLOCK_SIZE,
                                num_kv_blocks=NUM_BLOCKS, max_model_len=1024, num_swap_blocks=8,
                                max_num_seqs=max_num_seqs, enforce_eager=graph_device is None)
    config = dataclasses.replace(config, device_name=str(CUDA))
    weights = quantize_weights(random_weights(SMOLLM2, config.dtype), quantization)
    return ModelRunner(config, LlamaModel(SMOLLM2, weights, config.max_model_len), graph_device=graph_device)


def seq(i: int, num_tokens: int, num_computed: int, params: SamplingParams | None = None) -> Sequence:
    s = Sequence(str(i), [(7 * i + t) % SMOLLM2.vocab_size for t in range(num_tokens)],
                 params or SamplingParams(temperature=0), i, None)
    s.block_ids = [(5 * i + b) % NUM_BLOCKS for b in range(-(-num_tokens // BLOCK_SIZE))]
    s.num_computed_tokens = num_computed
    return s


BATCHES = {
    # two prompts in one step: a fresh one, and one whose first 32 tokens were a prefix-cache hit
    "prefills": (lambda: ScheduledBatch([seq(0, 40, 0), seq(1, 50, 32)], [40, 18]), 2),
    # eleven decodes (two attention groups), padded to 16
    "decodes": (lambda: ScheduledBatch([seq(i, 20 + 13 * i, 19 + 13 * i) for i in range(11)], [1] * 11), 11),
    # decodes then a prefill chunk, as a mixed step
    "mixed": (lambda: ScheduledBatch([seq(0, 40, 39), seq(1, 70, 69), seq(2, 100, 32)], [1, 1, 68]), 3),
}
