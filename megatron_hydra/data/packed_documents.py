"""Where documents start and end inside a GPT sample, from its EOD tokens (Megatron-LM's
``--eod-mask-loss``, ``--reset-position-ids``, ``--reset-attention-mask``).

A GPT sample runs across document boundaries (``gpt_dataset``); the EOD token the preprocessor
appended to each document marks where one ends. Three options turn that into batch fields:

- ``eod_mask_loss``: no loss where the *input* token is EOD (predicting the next document's
  first token from the end of another one is noise);
- ``reset_position_ids``: ``position_ids`` restart at 0 after every EOD, so each document sees
  the positions it would see alone;
- ``reset_attention_mask``: ``document_ids``, one id per document, increasing along the sample;
  attention stays within a document (``parallel.document_masks``). A document ends with its EOD:
  the EOD belongs to the document it ends, the token after it starts the next.

Together the last two make a packed sample compute what its documents would compute one by one.
The fields are the batch contract any packed dataset (e.g. SFT packing) produces alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch


@dataclass(frozen=True)
class DocumentFlags:
    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @property
    def any(self) -> bool:
        return self.eod_mask_loss or self.reset_position_ids or self.reset_attention_mask

    def fields(self, tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``loss_mask`` (float32), and ``position_ids`` / ``document_ids`` (long) when their
        option is on, for the input ``tokens`` of one sample ([seq] or [batch, seq])."""
        is_eod = tokens == self.eod
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        out = {"loss_mask": loss_mask}
        if self.reset_position_ids or self.reset_attention_mask:
            # the document of token j: how many EODs come before it
            ids = is_eod.long().cumsum(-1) - is_eod.long()
            if self.reset_attention_mask:
                out["document_ids"] = ids
            if self.reset_position_ids:
                positions = torch.arange(tokens.shape[-1]).expand(tokens.shape)
                # each token's document start: the last position right after an EOD, at or before it
                starts = torch.where(torch.cat([torch.ones_like(is_eod[..., :1]), is_eod[..., :-1]], -1),
                                     positions, torch.zeros_like(positions)).cummax(-1).values
                out["position_ids"] = positions - starts
        return out
