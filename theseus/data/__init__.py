"""Language-model data: corpora of token ids, their weighted mixtures and stateless samplers, and
preference pairs."""

from theseus.data.binfile import write_tokens
from theseus.data.corpus import Corpus
from theseus.data.mixture import Mixture, MixtureSampler, load_mixture
from theseus.data.preference import PreferencePair, PreferencePairs, load_pairs
from theseus.data.sampler import Sampler, validation_batches
from theseus.data.tokens import load_corpus

__all__ = [
    "Corpus",
    "Mixture",
    "MixtureSampler",
    "PreferencePair",
    "PreferencePairs",
    "Sampler",
    "load_corpus",
    "load_mixture",
    "load_pairs",
    "validation_batches",
    "write_tokens",
]
