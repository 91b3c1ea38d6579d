"""Hugging Face <-> megatron-hydra checkpoints (``python -m megatron_hydra.convert``)."""
