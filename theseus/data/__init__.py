"""Language-model data: corpora of token ids, their weighted mixtures and stateless samplers."""

from theseus.data.binfile import write_tokens
from theseus.data.corpus import Corpus
from theseus.data.mixture import Mixture, MixtureSampler, load_mixture
from theseus.data.sampler import Sampler, validation_batches
from theseus.data.tokens import load_corpus

__all__ = [
    "Corpus",
    "Mixture",
    "MixtureSampler",
    "Sampler",
    "load_corpus",
    "load_mixture",
    "validation_batches",
    "write_tokens",
]
