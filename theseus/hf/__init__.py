"""Hugging Face checkpoints in and out: `theseus import-hf` and `theseus export-hf`."""
