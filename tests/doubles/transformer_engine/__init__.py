"""TEST DOUBLE of NVIDIA Transformer Engine (see tests/doubles/README.md)."""
