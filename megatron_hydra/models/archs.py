"""The model families behind ``model.arch``: how to build one (a whole model or one pipeline
stage), how a micro-batch's loss is reduced, and which batch fields the model reads.

The training loop and the checkpoint code look the family up here and stay the same for all.
Every family's ``forward(tokens, **{key: batch[key] for key in inputs})`` returns a per-token
loss (with ``labels``) that ``loss(output, loss_mask)`` reduces; under pipeline parallelism the
``inputs`` reach every stage as keyword arguments (each stage reads what it needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

from megatron_hydra.models.bert import BertModel, bert_loss
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.t5 import T5Model
from megatron_hydra.parallel import collectives as C


def masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, cp_group=None) -> torch.Tensor:
    """Mean loss over a micro-batch's unmasked tokens. Under context parallelism (``cp_group``)
    each rank holds some tokens of every sequence: its sum is divided by the whole sequences'
    token count and multiplied by cp, so that the mean over the cp ranks (the gradient reduce
    averages over dp x cp) is the exact loss."""
    mask = loss_mask.to(per_token_loss.dtype)
    count = C.all_reduce(mask.sum(), cp_group)
    return (per_token_loss * mask).sum() * C.group_size(cp_group) / count


@dataclass(frozen=True)
class Arch:
    # (TransformerConfig, ParallelState, layers=None, pre_process=True, post_process=True, device=None)
    build: Callable[..., torch.nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    inputs: Tuple[str, ...]  # batch fields passed to forward as keywords, besides tokens (when present)


ARCHS: Dict[str, Arch] = {
    "gpt": Arch(GPTModel, masked_mean, ("labels", "position_ids", "document_ids")),
    "bert": Arch(BertModel, bert_loss, ("labels", "padding_mask", "token_types", "sop_labels")),
    "t5": Arch(T5Model, masked_mean, ("labels", "decoder_tokens", "padding_mask")),
}
