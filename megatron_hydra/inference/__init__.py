"""Inference at any layout: the engine that generates and scores with a rank's model stage
(``engine``), how the next token is chosen (``sampling``), and lm-evaluation-harness on top."""
