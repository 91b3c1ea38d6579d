"""TEST DOUBLE of NVIDIA apex (see tests/doubles/README.md)."""
