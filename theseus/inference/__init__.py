"""Text generation from checkpoints: a KV cache sharded like attention, under any layout."""

from theseus.inference.generate import Completion, Generation, generate, load_generator
from theseus.inference.generator import Generator
from theseus.inference.sampling import Sampling

__all__ = ["Completion", "Generation", "Generator", "Sampling", "generate", "load_generator"]
