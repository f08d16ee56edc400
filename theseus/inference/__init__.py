"""Text generation from checkpoints: a KV cache sharded like attention, under any layout."""

from theseus.inference.generate import Completion, Generation, Generator, generate, load_generator
from theseus.inference.sampling import Sampling

__all__ = ["Completion", "Generation", "Generator", "Sampling", "generate", "load_generator"]
