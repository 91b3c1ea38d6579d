"""megatron-hydra: Megatron-style parallel Transformer training driven by Hydra configs."""

__version__ = "0.1.0"
