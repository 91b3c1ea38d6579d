"""TEST DOUBLE of transformer_engine.common."""
