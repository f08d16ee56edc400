"""Models: the decoder pieces every family shares (parts, attention, the forward pass and cached
decoding, rotary embeddings) and the families, one module each under ``families/``."""
