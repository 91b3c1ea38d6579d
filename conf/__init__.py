"""conf/ is also the package ``megatron_hydra.conf`` (see ``megatron_hydra/config/bundled.py``)."""
