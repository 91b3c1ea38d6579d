"""The messages between pipeline stages while generating or scoring.

Stage 0 embeds, each stage hands its hidden state to the next, the last stage turns it into
tokens or scores. Sends are asynchronous: a stage goes on with its next micro-batch while the
following stage works on the one just sent, which is what lets the stages run concurrently. The
last stage sends every micro-batch's new tokens straight to every other stage, so all of them
know each sequence as soon as it exists (stage 0 to feed it back, all to agree on when it stops).
Between two stages the messages of one kind travel in one direction only, in order.

With one stage every method is free: nothing is sent.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Tuple

import torch
import torch.distributed as dist

from megatron_hydra.parallel.state import ParallelState

HIDDEN, TOKENS = 1, 2  # message tags: a stage's output, the last stage's new tokens
IN_FLIGHT = 8  # sends left unwaited before the oldest is waited for (their tensors stay alive till then)


class StageLink:
    def __init__(self, ps: ParallelState):
        self.size, self.rank = ps.pp_size, ps.pp_rank
        self.group = ps.pp_group if self.size > 1 else None
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        self._pending: Deque[Tuple[object, torch.Tensor]] = deque()

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def _isend(self, tensor: torch.Tensor, stage: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, self._peer(stage), self.group, tag), tensor))
        while len(self._pending) > IN_FLIGHT:
            self._pending.popleft()[0].wait()

    def send_forward(self, hidden: torch.Tensor) -> None:
        """This stage's output to the next stage."""
        self._isend(hidden.contiguous(), self.rank + 1, HIDDEN)

    def recv_forward(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """The previous stage's output, of the ``shape`` every stage computes for itself."""
        hidden = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(hidden, self._peer(self.rank - 1), self.group, HIDDEN)
        return hidden

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """The last stage's new tokens to every other stage."""
        for stage in range(self.size - 1):
            self._isend(tokens, stage, TOKENS)

    def recv_tokens(self, count: int, device) -> torch.Tensor:
        tokens = torch.empty(count, dtype=torch.long, device=device)
        dist.recv(tokens, self._peer(self.size - 1), self.group, TOKENS)
        return tokens

    def from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's ``tensor`` on every stage (the others pass one of its shape)."""
        if self.size > 1 and tensor.numel():
            dist.broadcast(tensor, self._peer(self.size - 1), self.group)
        return tensor

    def flush(self) -> None:
        """Wait for every send still in flight."""
        while self._pending:
            self._pending.popleft()[0].wait()
