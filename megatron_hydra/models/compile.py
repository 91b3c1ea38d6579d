"""Regional compilation: ``torch.compile`` of each transformer block, as torchtitan does.

Why per block and not the whole model: every block of a stack has the same code and shapes, and
dynamo lifts a module's parameters into graph inputs, so one compiled graph serves every layer:
the cold compile costs one block, not the model. What lies between blocks stays eager and
unchanged: the embedding and head, the pipeline schedule around a chunk, the recompute regions
(``parallel.recompute`` checkpoints around compiled blocks, so the replay runs the same compiled
graph and what a region frees is unchanged). Collectives inside a block (tensor, sequence and
context parallelism) are autograd Functions calling ``torch.distributed``: dynamo breaks the
graph around them and they run as they do eagerly.

Only training runs compiled. A block in evaluation mode or given a KV cache (validation,
generation, lm-evaluation-harness: other lengths at every call) runs its eager forward, so
dynamo never sees those shapes and never recompiles for them. Training shapes are fixed
(``dynamic=False``): one graph per distinct block, compiled once.
"""

from __future__ import annotations

from types import MethodType
from typing import List

import torch
from torch import nn

from megatron_hydra.models.transformer import Block


class CompiledBlocks:
    """The compiled ``Block.forward`` shared by the blocks it was installed on; ``calls`` counts
    the calls that took the compiled path (what tests read to know it ran)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.forward = torch.compile(Block.forward, backend=backend, dynamic=False)
        self.blocks: List[Block] = []
        self.calls = 0

    def __call__(self, block: Block, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if block.training and kwargs.get("kv_cache") is None and not args:
            self.calls += 1
            return self.forward(block, x, *args, **kwargs)
        return Block.forward(block, x, *args, **kwargs)


def compile_blocks(model: nn.Module, backend: str = "inductor") -> CompiledBlocks:
    """Compile every transformer block of ``model`` (a model or a ``ModuleList`` of pipeline
    chunks) on first use, with ``backend`` (``trainer.compile_backend``). Parameter names, state
    dicts and hooks are those of the eager model: only each block's ``forward`` is replaced."""
    compiled = CompiledBlocks(backend)
    for module in model.modules():
        if isinstance(module, Block):
            module.forward = MethodType(compiled, module)
            compiled.blocks.append(module)
    return compiled
