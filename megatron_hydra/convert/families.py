"""The Hugging Face families an import and an export know, one module each (``convert/<family>.py``:
its ``MODEL_TYPE``, ``ARCH``, ``NAME_MAP``, ``model_config``, ``compatible`` and ``hf_config``).

Import dispatches on ``config.json``'s ``model_type``; export on the checkpoint's ``model.arch``,
then on the first family (in this order) whose ``compatible`` accepts the model: the plainest
family that expresses it, so a Llama-shaped model exports as Llama, not as a look-alike.
"""

from __future__ import annotations

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import bert, gpt2, llama, mixtral, t5
from megatron_hydra.errors import ConfigError

FAMILIES = {family.MODEL_TYPE: family for family in (gpt2, llama, bert, t5, mixtral)}


def family_for(tcfg: TransformerConfig):
    """The Hugging Face family a model of ours exports as."""
    candidates = [family for family in FAMILIES.values() if family.ARCH == tcfg.arch]
    reasons = [family.compatible(tcfg) for family in candidates]
    for family, why in zip(candidates, reasons):
        if not why:
            return family
    raise ConfigError(f"this model (position_embedding={tcfg.position_embedding}, normalization={tcfg.normalization}, "
                      f"activation={tcfg.activation}) has no Hugging Face counterpart: {'; '.join(reasons)}")
