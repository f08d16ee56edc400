"""Language-model data: corpora of token ids and a stateless sampler over their windows."""

from theseus.data.sampler import Sampler, validation_batches
from theseus.data.tokens import Corpus, load_corpus, write_tokens

__all__ = ["Corpus", "Sampler", "load_corpus", "validation_batches", "write_tokens"]
