"""Layout-independent initialisation (Megatron's rules), computed shard by shard.

Every element of a logical (unsharded) parameter has its initial value as a pure function of the
run seed, the parameter's logical name and the element's index in the logical tensor (row-major):
a counter-based generator. A rank computes only the elements it holds, from its TP-local shape
and its shard's offset along ``tp_partition_dim``; nothing is drawn whole, so a 70B model's 4 GB
embedding costs each of tp ranks 1/tp of it, and the values are the same for every tp, pp and dp
(adding a layer never changes the others). The work runs in chunks of ``chunk_elements(device)``
elements on the tensor's own device, so its temporary memory is bounded (a few MB on CPU).

The generator: murmur3's 32-bit finaliser (``_fmix``), done in int64 torch ops masked to 32 bits
(every product fits in int64: constants above 2^31 are used as their negative 32-bit twins),
keyed by (seed, crc32(name)); three keyed rounds per element give two 32-bit uniforms, and
Box-Muller turns them into one normal, in float64, then cast to the parameter's dtype.

Rules: weights normal(0, init_std); projections into the residual stream (attention.proj, mlp.fc2,
and a Mixture of Experts' expert and shared-expert fc2) normal(0, init_std / sqrt(2 * num_layers));
biases zero; norm weights one, or zero where they scale by (1 + w) (``zero_centered_gamma``).
LoRA adapters (``models.lora``) as ``peft`` makes them: A Kaiming-uniform (torch's default for a
linear layer: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in the logical input width), B zero.
Vocabulary tables draw only their ``vocab_size`` real rows; the padding rows (whose number depends
on tp) are zero, so the real rows are the same whatever the padding.

A Mixture of Experts holds its local experts stacked in one parameter ([E_local, ...]): each
expert's slice is filled from that expert's own logical name (``models.moe.local_experts``), so
the experts are the same whatever the expert- and tensor-parallel sizes.

Models are built on the meta device and given storage here (``materialize``): each parameter is
allocated on the target device and filled there, so no CPU copy of the model exists on the way.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Optional, Sequence

import torch
from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.models.backends import logical_parameters
from megatron_hydra.parallel.lora import is_down_projection

OUTPUT_PROJECTIONS = ("attention.proj.weight", "mlp.fc2.weight")
MOE_OUTPUT_PROJECTION = re.compile(r"(^|\.)(shared|experts\.\d+)\.fc2\.weight$")
# [padded_vocab, ...], vocab-parallel; BERT's masked-LM bias is one too (zero like every bias).
VOCAB_TABLES = ("embedding.weight", "output_weight", "lm_head.bias")

_MASK = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _signed(c: int) -> int:
    """The int64 factor congruent to the 32-bit constant ``c`` with |factor| < 2^31."""
    return c - (1 << 32) if c >= 1 << 31 else c


_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3 fmix32
_S1, _S2 = _signed(_M1), _signed(_M2)


def _fmix_int(h: int) -> int:
    h &= _MASK
    h ^= h >> 16
    h = (h * _M1) & _MASK
    h ^= h >> 13
    h = (h * _M2) & _MASK
    return h ^ (h >> 16)


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors holding 32-bit values, in place."""
    h.bitwise_xor_(h >> 16).mul_(_S1).bitwise_and_(_MASK)
    h.bitwise_xor_(h >> 13).mul_(_S2).bitwise_and_(_MASK)
    return h.bitwise_xor_(h >> 16)


def parameter_keys(seed: int, name: str) -> Sequence[int]:
    """The four 32-bit round keys of parameter ``name`` under run seed ``seed``."""
    seed %= 1 << 64
    k = _fmix_int(_fmix_int(zlib.crc32(name.encode()) ^ _GOLDEN) ^ (seed & _MASK))
    k = _fmix_int(k ^ (seed >> 32) ^ 0x68E31DA4)
    return [_fmix_int(k + i * _GOLDEN) for i in range(1, 5)]


def _hashes(index: torch.Tensor, keys: Sequence[int], max_index: Optional[int]):
    """Two independent 32-bit hashes (int64 tensors) of the logical indices ``index`` under ``keys``."""
    k0, k1, k2, k3 = keys
    h = _fmix((index & _MASK) ^ k0)
    a, b = h ^ k1, h.bitwise_xor_(k2)
    if max_index is None or max_index >> 32:
        # Indices 2^32 apart share h: their uniforms are keyed by the high word too (0 below 2^32).
        hi = index >> 32
        high = hi != 0
        a.bitwise_xor_(_fmix(hi ^ k3).mul_(high))
        b.bitwise_xor_(_fmix(hi.bitwise_xor_(k3 ^ k0)).mul_(high))
    return _fmix(a), _fmix(b)


def normal_at(index: torch.Tensor, keys: Sequence[int], max_index: Optional[int] = None) -> torch.Tensor:
    """Standard normal values (float64) at the logical element indices ``index`` (int64 >= 0), a
    pure function of (keys, index). ``max_index``: a bound on ``index`` known on the host (skips
    the high-word rounds when every index fits 32 bits, without reading the tensor)."""
    a, b = _hashes(index, keys, max_index)
    radius = a.to(torch.float64).add_(0.5).mul_(2.0 ** -32).log_().mul_(-2.0).sqrt_()
    return radius.mul_(b.to(torch.float64).mul_(2.0 * math.pi * 2.0 ** -32).cos_())


def uniform_at(index: torch.Tensor, keys: Sequence[int], max_index: Optional[int] = None) -> torch.Tensor:
    """Uniform values in (-1, 1) (float64) at the logical element indices ``index``, as ``normal_at``."""
    a, _ = _hashes(index, keys, max_index)
    return a.to(torch.float64).add_(0.5).mul_(2.0 ** -31).sub_(1.0)


def chunk_elements(device: torch.device) -> int:
    """Elements per chunk: small on CPU (cache-resident temporaries), larger on accelerators
    (fewer kernel launches). A device module may set its own (``init_chunk_elements``): the dry
    run's stand-in GPU, whose tensors hold no values, fills each tensor as one chunk."""
    device = torch.device(device)
    if device.type == "cpu":
        return 1 << 18
    return getattr(torch.get_device_module(device.type), "init_chunk_elements", 1 << 20)


def _rule(name: str, cfg: TransformerConfig):
    """("zero" | "one" | "normal" | "uniform", std) for parameter ``name`` (uniform: the bound is
    set from the tensor's width)."""
    if ".lora." in name:
        return ("uniform", 0.0) if is_down_projection(name) else ("zero", 0.0)
    if name.endswith(".bias"):
        return "zero", 0.0
    if "norm" in name:
        return ("zero" if cfg.zero_centered_gamma else "one"), 0.0
    output = name.endswith(OUTPUT_PROJECTIONS) or MOE_OUTPUT_PROJECTION.search(name) is not None
    return "normal", cfg.output_init_std if output else cfg.init_std


@torch.no_grad()
def fill_shard(out: torch.Tensor, name: str, cfg: TransformerConfig, seed: int, dim: Optional[int] = None,
               shard: int = 0, num_shards: int = 1, chunk: Optional[int] = None) -> None:
    """Fill ``out`` with its part of logical parameter ``name``: shard ``shard`` of ``num_shards``
    equal slices along ``dim`` (None: the whole tensor), chunk by chunk on ``out``'s device."""
    kind, std = _rule(name, cfg)
    if kind in ("zero", "one"):
        out.fill_(0.0 if kind == "zero" else 1.0)
        return
    shape = list(out.shape)
    if kind == "uniform":  # an adapter's A [rank, in]: Kaiming-uniform over the logical input width
        std = 1.0 / math.sqrt(shape[1] * (num_shards if dim == 1 else 1))
    draw = uniform_at if kind == "uniform" else normal_at
    flat = out.view(-1)  # contiguous: a parameter or a row range of one
    # logical index of local flat index j: j + (j // (B_loc * C)) * (B - B_loc) * C + offset * C,
    # with B_loc / B the local / logical size along ``dim`` and C the elements behind it.
    sharded = dim is not None and num_shards > 1
    local_b = shape[dim] if sharded else 1
    behind = math.prod(shape[dim + 1:]) if sharded else 1
    block, skip = local_b * behind, (num_shards - 1) * local_b * behind
    base = shard * local_b * behind if sharded else 0
    real = out.numel()
    if name in VOCAB_TABLES:  # rows past vocab_size are padding: zero (split along rows, dim 0)
        real = max(0, min(real, cfg.vocab_size * math.prod(shape[1:]) - base))
        flat[real:].zero_()
    keys = parameter_keys(seed, name)
    step = chunk or chunk_elements(out.device)
    for start in range(0, real, step):
        stop = min(start + step, real)
        j = torch.arange(start, stop, dtype=torch.int64, device=out.device)
        if sharded and skip and out.numel() > block:
            index = (j // block).mul_(skip).add_(j).add_(base)
        else:
            index = j.add_(base)
        last = stop - 1 + (stop - 1) // block * skip + base
        flat[start:stop].copy_(draw(index, keys, max_index=last).mul_(std))


def logical_tensor(name: str, shape, cfg: TransformerConfig, seed: int, dtype: torch.dtype = torch.float32,
                   device="cpu") -> torch.Tensor:
    """The whole initial value of parameter ``name`` of logical ``shape`` (for tests and tools;
    training never builds one): the same function as every shard's, over the whole index range."""
    out = torch.empty(list(shape), dtype=dtype, device=device)
    fill_shard(out, name, cfg, seed)
    return out


@torch.no_grad()
def init_weights(model: nn.Module, cfg: TransformerConfig, seed: int, tp_rank: int, tp_size: int) -> None:
    """Fill every parameter of ``model`` (this TP rank's shards) with its initial value."""
    # By logical name, whichever implementation holds them; an MoE layer's stacked experts one by one.
    for lp in logical_parameters(model):
        fill_shard(lp.tensor, lp.name, cfg, seed, lp.tp_dim, tp_rank, tp_size)


def _on_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"  # not ``is_meta``: a fake tensor (the dry run's) says False


def materialize(model: nn.Module, cfg: TransformerConfig, seed: int, tp_rank: int, tp_size: int,
                device=None) -> nn.Module:
    """Give a model built on the meta device its storage on ``device`` and its initial values:
    each parameter is allocated there (keeping its tags and its sharing between modules) and
    filled in place; buffers are recomputed by their module's ``reset_buffers(device)``.
    ``device`` None: torch's default device."""
    device = torch.get_default_device() if device is None else torch.device(device)
    done = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is None or not _on_meta(p):
                continue
            if id(p) not in done:
                q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                # Our tags (tp_partition_dim, logical, shared_embedding, ...), not a fake tensor's own
                # fields (fake_device: the dry run's parameters are fake tensors).
                q.__dict__.update({k: v for k, v in p.__dict__.items() if k not in q.__dict__})
                done[id(p)] = q
            module._parameters[key] = done[id(p)]
        if any(b is not None and _on_meta(b) for b in module._buffers.values()):
            module.reset_buffers(device)
        for key, value in vars(module).items():  # placeholders such as TE's bias=False tensor
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and _on_meta(value):
                if value.numel():
                    raise ValueError(f"{type(module).__name__}.{key} is a meta tensor with values, which "
                                     "materialize cannot recompute: make it a buffer with reset_buffers")
                setattr(module, key, torch.empty(value.shape, dtype=value.dtype, device=device))
    init_weights(model, cfg, seed, tp_rank, tp_size)
    return model
