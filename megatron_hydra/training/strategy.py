"""MegatronStrategy: Lightning's view of a rank in a (pp, dp, cp, tp) grid.

It holds the process environment, the device and the model's wrapping, nothing of a step. The
process group already exists when Lightning starts (our launcher, torchrun or SLURM created it),
so the strategy launches nothing: it exposes the ranks to Lightning and wraps the model
(``wrap_model``): it attaches the data-parallel gradient buffer to the model's parameters, or,
with ``parallel.data_parallel=fsdp``, shards the model with FSDP (``parallel.fsdp``). Zeroing,
the no-sync of accumulating micro-batches, finishing the reduce and the gradient norm belong to
the step (``training.step``). How layers are sharded is not its concern: it only reads the tags
the parallel layers put on parameters.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import ClusterEnvironment
from pytorch_lightning.strategies import ParallelStrategy

from megatron_hydra.models.transformer import Block
from megatron_hydra.parallel import fsdp
from megatron_hydra.parallel.data_parallel import GradBuffer
from megatron_hydra.parallel.state import ParallelState


class _ProcessGroupEnvironment(ClusterEnvironment):
    """Ranks as torch.distributed already knows them (or a single process)."""

    def __init__(self, local_rank: int, node_rank: int):
        self._local_rank, self._node_rank = local_rank, node_rank

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._local_rank

    def node_rank(self) -> int:
        return self._node_rank


class MegatronStrategy(ParallelStrategy):
    def __init__(self, parallel_state: ParallelState, device: torch.device, *, grad_bucket_size: int,
                 distributed_optimizer: bool = False, data_parallel: str = "ddp", overlap_grad_reduce: bool = True,
                 local_rank: int = 0, node_rank: int = 0):
        super().__init__(parallel_devices=[device],
                         cluster_environment=_ProcessGroupEnvironment(local_rank, node_rank))
        self.parallel_state = parallel_state
        self.grad_bucket_size = grad_bucket_size
        self.distributed_optimizer = distributed_optimizer
        self.overlap_grad_reduce = overlap_grad_reduce  # buckets reduce during backward, not all at its end
        self.fsdp = data_parallel == "fsdp"
        self.fsdp_chunks: list = []  # fsdp: the model chunks, each an FSDP root
        self.grad_buffer: Optional[GradBuffer] = None
        self._launcher = None

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.parallel_state.dp_size, "rank": self.parallel_state.dp_rank}

    def setup_environment(self) -> None:
        from pytorch_lightning.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank
        super().setup_environment()

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Lightning's hook at setup: the model wrapped in place (``wrap_model``)."""
        self.wrap_model(model)
        return model

    def wrap_model(self, module: torch.nn.Module) -> None:
        """Give ``module`` (an ``LMModule``, or any model) its data parallelism, before its optimizer is
        built: a gradient buffer over its parameters (``grad_buffer``, which the optimizer and the
        step read), or FSDP sharding of its chunks (``grad_buffer`` stays None)."""
        if self.fsdp:
            self._shard(module)
            return
        ps = self.parallel_state
        self.grad_buffer = GradBuffer(module.parameters(), ps.dp_cp_group, self.grad_bucket_size,
                                      distributed=self.distributed_optimizer, expert_dp_group=ps.expert_dp_group,
                                      overlap=self.overlap_grad_reduce)

    def _shard(self, module: torch.nn.Module) -> None:
        """FSDP over the data-parallel group: each transformer block a unit, each model chunk a root.
        With pipeline parallelism blocks stay gathered between a micro-batch's forward and backward
        (many are in flight; gathering each twice would double the traffic)."""
        inner = module.model
        self.fsdp_chunks = list(inner) if isinstance(inner, torch.nn.ModuleList) else [inner]
        blocks = [[m for m in chunk.modules() if isinstance(m, Block)] for chunk in self.fsdp_chunks]
        dtype = next(inner.parameters()).dtype
        fsdp.shard_chunks(self.fsdp_chunks, blocks, self.parallel_state, dtype,
                          reshard_after_forward=self.parallel_state.pp_size == 1)

    # Collectives Lightning uses (metric sync, barriers) ------------------------------------------
    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"):
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized() or dist.get_world_size() == 1:
            return tensor
        name = str(reduce_op).lower().rsplit(".", 1)[-1] if reduce_op is not None else "mean"
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM}
        if name not in ops:
            raise ValueError(f"unsupported reduce_op {reduce_op!r}")
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=ops[name], group=group)
        return tensor / dist.get_world_size(group) if name in ("mean", "avg") else tensor

    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src=src)
        return objects[0]

    def teardown(self) -> None:
        for optimizer in self.optimizers:
            inner = getattr(optimizer, "_optimizer", optimizer)
            if hasattr(inner, "close"):
                inner.close()
        if self.grad_buffer is not None:
            self.grad_buffer.close()
        self.grad_buffer = None
        super().teardown()
