"""A GPU that exists only as tensor metadata, for the dry run (``training.dry_run``).

Tensors are torch's fake tensors (``FakeTensorMode``): shape, dtype and device, no storage, so a
175B model's rank costs nothing to build. Their device is a stand-in accelerator registered as
torch's ``PrivateUse1`` backend under the name ``FAKE_DEVICE`` rather than ``cuda`` itself: on a
CPU-only torch build a fake tensor *on* ``cuda`` works for forward ops, but the first autograd
edge on it aborts the process (autograd records each input's stream through the CUDA device-guard,
which a CPU build does not have; measured with torch 2.13), and torch refuses to give the
``PrivateUse1`` backend an in-tree name. The stand-in behaves as a GPU does where it matters here:
a CPU tensor (other than a 0-dim scalar) meeting it in an op is an error, and so is code that
hard-codes ``"cuda"`` instead of using the bound device.

Two checks run on every op, inside the fake mode (``DeviceAndDtypeCheck``):

- devices: the op's tensors are on one device (0-dim CPU scalars aside, as on a GPU);
- dtypes: the matmul-like ops (the ones whose GPU kernels refuse mixed inputs, e.g. bf16 weights
  times an fp32 activation) get one floating dtype; fake kernels would let these through.

A failure names the op and the innermost line of this package that called it. Reads of a tensor
value on the host (``.item()``, ``bool(t)``) are answered from the value a fake tensor still knows
(small tensors made from Python numbers, such as Adam's step count, keep theirs), else with
zero/False; a read of a device tensor (a device-to-host sync on a GPU) is counted, so the dry run
also reports how many syncs one step makes. ``pin_memory`` (a host-allocator property without device semantics)
returns the tensor itself.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from contextlib import ExitStack, contextmanager
from typing import Iterator, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_hydra.errors import MegatronHydraError
from megatron_hydra.parallel import pipeline_runtime

FAKE_DEVICE = "fakegpu"
# The dry run's device is index 0 of the stand-in: torch's autograd engine sizes its per-device
# queues from the backend's device count, which a Python-registered backend reports as 1. Which GPU
# a rank binds is proven separately (the device-binding tests).

# The directory holding the megatron_hydra package (frames below it are shown relative to it).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MATMUL_OPS = {
    "aten.mm.default", "aten.mm.out", "aten.addmm.default", "aten.addmm.out", "aten.bmm.default",
    "aten.baddbmm.default", "aten.addmv.default",
    "aten.mv.default", "aten.dot.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default", "aten.convolution.default",
}


class DryRunError(MegatronHydraError):
    """The step would fail on the GPU: the message names the op and where this package called it."""


# Whether a dry run is in progress. Outside one the stand-in reports itself unavailable to the
# run-time checks that ask (``is_available``). That does not keep it from being torch's current
# accelerator once registered, ahead of CUDA: see ``register``.
_active = False


class _DeviceModule:
    """``torch.<FAKE_DEVICE>``: what torch asks of a device module (``torch.cuda``'s counterpart)
    when it forks random states or synchronises. A fake device has no random state: an empty one
    is saved and restored."""

    # Fake tensors hold no values: ``models.init`` fills each one as a single chunk (the same ops,
    # none of the loop), and the dry run measures the step's peak from after initialisation.
    init_chunk_elements = 1 << 62

    def is_available(self) -> bool:
        return _active

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, state, device=None) -> None:
        pass

    def get_amp_supported_dtype(self):
        """What ``torch.amp.autocast`` asks of a backend: activation recompute replays its region
        under the forward's autocast state on this device (a GPU's 16-bit types)."""
        return [torch.float16, torch.bfloat16]

    # FSDP (parallel.data_parallel=fsdp) runs its collectives on side streams ordered by events. The
    # stand-in computes nothing, so one stream is all it has: the host's no-op stream and event.
    Stream = torch.cpu.Stream
    Event = torch.cpu.Event

    def current_stream(self, device=None):
        return torch.cpu.current_stream(device)

    def stream(self, stream):
        return torch.cpu.stream(stream)


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """What torch's C++ side asks of the backend: available only during a dry run."""

    def is_available(self) -> bool:
        return _active

    def has_primary_context(self, dev_id) -> bool:
        return _active

    def is_built(self) -> bool:
        return True


def registered() -> bool:
    """Whether the stand-in is a device type of this process (the dry run can run here)."""
    return torch._C._get_privateuse1_backend_name() == FAKE_DEVICE


def register(own_process: bool = False) -> torch.device:
    """Make ``FAKE_DEVICE`` a device type of this process (once; torch allows one rename) and
    return the device the dry run runs on.

    A registered ``PrivateUse1`` backend becomes torch's current accelerator, ahead of a real one,
    so in a process that can use CUDA (or any real accelerator) it breaks CUDA: NCCL's
    ``init_process_group(device_id=cuda:N)`` and the autograd engine's stream bookkeeping then look
    at the stand-in (both seen on an H200). There it is registered only by a process that exists
    for the dry run alone (``own_process=True``); the dry run starts such a process
    (``training.dry_run``)."""
    from torch.utils import backend_registration

    name = torch._C._get_privateuse1_backend_name()
    if name == FAKE_DEVICE:
        return torch.device(FAKE_DEVICE, 0)
    if REAL_ACCELERATOR and not own_process:
        raise DryRunError(f"this process can use a real accelerator ({REAL_ACCELERATOR}), which the fake GPU would "
                          "displace: run the dry run through training.dry_run.dry_run, which starts its own process")
    if name != "privateuseone":
        raise DryRunError(f"the dry run needs torch's PrivateUse1 backend, but this process already registered it as "
                          f"{name!r}: run the dry run in its own process")
    backend_registration._setup_privateuseone_for_python_backend(rename=FAKE_DEVICE, backend_module=_DeviceModule(),
                                                                 hook=_Hooks())
    _register_gpu_kernels()
    return torch.device(FAKE_DEVICE, 0)


# The stand-in's kernel choices, kept alive for the process (a dropped Library unregisters them).
_KERNELS: List[torch.library.Library] = []


def _register_gpu_kernels() -> None:
    """Attention and RMSNorm take the GPU's fused kernels on the stand-in (``_fused_attention``,
    ``_fused_rms_norm``), as kernels of the device's own dispatch key rather than a torch-function
    mode: a mode is thread-local, and autograd runs a device's backward, activation recompute's
    replay among it, on a thread of its own, where a mode of the forward's thread is not active.
    Both ops are composites; a kernel for the device's autograd key takes their place there only."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _fused_attention, "AutogradPrivateUse1")
    lib.impl("rms_norm", _fused_rms_norm, "AutogradPrivateUse1")
    _KERNELS.append(lib)


def caller() -> str:
    """The innermost frame of the code being checked (not torch's, Lightning's, the standard
    library's or this module's), as ``path:line in function``."""
    skip = [os.path.dirname(m.__file__) for m in _library_modules()] + [sysconfig.get_paths()["stdlib"]]
    here = os.path.abspath(__file__)
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path != here and not any(path.startswith(s + os.sep) for s in skip):
            shown = os.path.relpath(path, _PACKAGE_ROOT) if path.startswith(_PACKAGE_ROOT + os.sep) else path
            return f"{shown}:{frame.lineno} in {frame.name}"
    return "unknown"


def _library_modules():
    import lightning_fabric
    import pytorch_lightning

    return (torch, pytorch_lightning, lightning_fabric)


class DeviceAndDtypeCheck(TorchDispatchMode):
    """Device and dtype checks per op, and the count of host reads (module docstring)."""

    def __init__(self):
        super().__init__()
        self.host_syncs: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name == "aten._local_scalar_dense.default":
            return self._host_read(args[0])
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1 and not name.startswith(("aten._to_copy", "aten.copy_", "aten.lift_fresh")):
            shown = ", ".join(sorted(str(d) for d in devices))
            raise DryRunError(f"{name} mixes devices ({shown}) at {caller()}: a CPU tensor meets GPU tensors, which "
                              "fails on the GPU; create it on the input's device")
        if name in _MATMUL_OPS:
            dtypes = {t.dtype for t in tensors if t.is_floating_point()}
            if len(dtypes) > 1:
                shown = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
                raise DryRunError(f"{name} mixes dtypes ({shown}) at {caller()}: the GPU kernel refuses mixed inputs; "
                                  "cast to the parameters' dtype")
        return func(*args, **kwargs)

    def _host_read(self, t: torch.Tensor):
        """A tensor's value read on the host. A value fake tensors still know (small tensors
        made from Python numbers, e.g. Adam's step count, and arithmetic on them) is returned;
        otherwise zero/False. A read of a device tensor is a sync on a GPU and is counted."""
        if t.device.type != "cpu":
            self.host_syncs.append(caller())
        constant = getattr(t, "constant", None)
        if constant is not None:
            return constant.item()
        return False if t.dtype == torch.bool else 0


class _AsOnGpu(TorchFunctionMode):
    """What a GPU's host side does otherwise than the stand-in's, on the forward's thread only (the
    GPU's kernel choices are dispatcher registrations instead, ``_register_gpu_kernels``, which
    hold on every thread): ``pin_memory`` has no meaning for fake tensors (the tensor stands for
    its pinned self); host tensors with a known value move through ``_to_device``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.is_pinned:
            return True
        device = kwargs.get("device")
        if func is torch.tensor and device is not None and torch.device(device).type != "cpu":
            host = func(*args, **{**kwargs, "device": "cpu", "requires_grad": False})
            return _to_device(host, torch.device(device), host.dtype).requires_grad_(kwargs.get("requires_grad", False))
        if func is torch.Tensor.to and getattr(args[0], "constant", None) is not None:
            to_kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **to_kwargs)
            if device is not None and device.type != "cpu":
                return _to_device(args[0], device, dtype or args[0].dtype)
        return func(*args, **kwargs)


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as a GPU runs it: the flash kernel (grouped-query heads
    natively), or the memory-efficient one when there is a mask. Torch picks a kernel by device,
    and for the stand-in it would pick the unfused one, whose s^2 probabilities a GPU never
    keeps: the dry run's activation bytes would not be the GPU's."""
    aten = torch.ops.aten
    if attn_mask is None:
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask.to(q.dtype) if attn_mask.dtype == torch.bool
                                                       else attn_mask, True, dropout_p, is_causal, scale=scale)[0]


class _FusedRMSNorm(torch.autograd.Function):
    """Torch's CUDA RMSNorm kernel as the dry run sees it: an output like the input, and for
    backward the input and the fp32 inverse RMS per row (nothing else is kept). Fake tensors carry
    no values, so shapes, dtypes and what is saved are all there is to model; the stand-in device
    would otherwise take torch's composite path, which keeps fp32 intermediates a GPU never makes."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape):
        rstd = torch.empty(*x.shape[:x.dim() - len(normalized_shape)], *(1,) * len(normalized_shape),
                           dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        return torch.empty_like(x), (torch.empty_like(weight) if weight is not None else None), None


def _fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    """``rms_norm`` as torch runs it on a GPU (``_FusedRMSNorm``)."""
    return _FusedRMSNorm.apply(x, weight, tuple(normalized_shape))


def _to_device(host: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor whose value fake tensors still know (``torch.tensor(...)`` data, Adam's step
    count) moved to the stand-in device: fake mode would compute the move on the real value, for
    which the stand-in has no kernel. The copy is fake like everything else."""
    return torch.empty(host.shape, dtype=dtype, device=device).copy_(host)


def _balanced_plan(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, group, cap: Optional[int] = None):
    """``parallel.expert_dispatch.plan`` for tensors without values: balanced routing (the memory
    plan's assumption), identical on every EP rank, no host read. The shapes, the count exchange
    and the kernels are a run's."""
    from megatron_hydra.parallel import collectives as C
    from megatron_hydra.parallel.expert_dispatch import Plan, balanced_counts

    experts = indices.reshape(-1)
    per_expert = balanced_counts(experts.numel(), num_experts, cap)
    ep, me = C.group_size(group), C.group_rank(group)
    local = num_experts // ep
    C.all_to_all(experts.new_tensor(per_expert), group, kind="ep_a2a")  # the exchange a run makes, unread
    send = [sum(per_expert[r * local:(r + 1) * local]) for r in range(ep)]
    mine = per_expert[me * local:(me + 1) * local]
    kept = torch.argsort(experts, stable=True)[:sum(per_expert)]
    to_expert = to_source = None
    if ep > 1:  # two permutations of the received rows, as a run holds
        to_expert, to_source = (torch.arange(ep * sum(mine), device=indices.device) for _ in range(2))
    return Plan(kept, kept // indices.shape[1], send, [sum(mine)] * ep, [ep * n for n in mine], to_expert,
                to_source, experts.numel() - kept.numel())


def _balanced_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``expert_counts`` without values: bincount's output shape would depend on them."""
    from megatron_hydra.parallel.expert_dispatch import balanced_counts

    return experts.new_tensor(balanced_counts(experts.numel(), num_experts))


def _routing_without_values() -> ExitStack:
    """The expert routing's data-dependent steps answered with balanced routing while the dry run
    runs, and only then (the two functions ``models.moe`` calls through their module)."""
    from unittest import mock

    from megatron_hydra.parallel import expert_dispatch

    stack = ExitStack()
    stack.enter_context(mock.patch.object(expert_dispatch, "plan", _balanced_plan))
    stack.enter_context(mock.patch.object(expert_dispatch, "expert_counts", _balanced_counts))
    return stack


@contextmanager
def fake_gpu(check: Optional[DeviceAndDtypeCheck] = None) -> Iterator[DeviceAndDtypeCheck]:
    """Within the block every tensor is fake and every op is checked; only where ``registered()``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    global _active
    check = check or DeviceAndDtypeCheck()
    with ExitStack() as stack:
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(check)
        stack.enter_context(_AsOnGpu())
        stack.enter_context(_routing_without_values())
        stack.enter_context(pipeline_runtime.warmup_vote_settled())
        _active = True
        try:
            yield check
        finally:
            _active = False


def _real_accelerator() -> Optional[str]:
    """The real accelerator this process could use, or None. On a CUDA build, the device count
    (``torch.cuda.device_count``), which asks NVML first and then does not initialise CUDA here: a
    process that imports the dry run may still fork workers that use the GPU."""
    if torch.backends.cuda.is_built():
        return "cuda" if torch.cuda.device_count() > 0 else None
    return str(torch.accelerator.current_accelerator()) if torch.accelerator.is_available() else None


# Looked up before the stand-in is registered, which would make it the answer.
REAL_ACCELERATOR = _real_accelerator()

# Registered on import, not on first use: torch's autograd engine sizes its per-device queues at
# the first backward of the process, and a device type that appears later has none. Not where a
# real accelerator is usable (``register``): there the dry run runs in a process of its own.
if REAL_ACCELERATOR is None:
    register()
