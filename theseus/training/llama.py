"""The Llama trainer: the Llama-family model and plan plugged into BaseTrainer."""

from __future__ import annotations

from typing import ClassVar

import pydantic
from flax import nnx

from theseus.accounting.preflight import check_context_length
from theseus.data import Corpus
from theseus.model.llama import LLAMA_PLAN, Llama, LlamaConfig
from theseus.model.llama_decode import LlamaDecoder
from theseus.sharding.axis import ShardingPlan
from theseus.training.flops import llama_flops_per_token
from theseus.training.trainer import BaseTrainer, TrainerConfig


class LlamaTrainerConfig(TrainerConfig):
    """Llama-family training: the shared training sections plus the model's hyperparameters."""

    model: LlamaConfig = pydantic.Field(default_factory=LlamaConfig)


class LlamaTrainer(BaseTrainer):
    """Next-token training of :class:`Llama` (pretraining, or fine-tuning with --init-from)."""

    config_class: ClassVar[type[TrainerConfig]] = LlamaTrainerConfig
    plan: ClassVar[ShardingPlan] = LLAMA_PLAN

    def __init__(self, config: LlamaTrainerConfig, policy, topology=None):
        context = config.model.max_position_embeddings
        check_context_length(
            config.training,
            context,
            "model.max_position_embeddings",
            window=config.model.sliding_window,
        )
        super().__init__(config, policy, topology)

    def build_model(self, rngs: nnx.Rngs) -> Llama:
        return Llama(
            self.config.model,
            rngs=rngs,
            compute_dtype=self.compute_dtype,
            remat=self.policy.activation_checkpointing,
            lora=self.lora_spec,
        )

    def decoder(self) -> LlamaDecoder:
        """Cached decoding for ``theseus generate`` (see theseus.model.decode)."""
        spec = self.lora_spec
        return LlamaDecoder(
            self.config.model, self.compute_dtype, 0.0 if spec is None else spec.scale
        )

    def default_seq_len(self) -> int:
        return self.config.model.context_len

    def flops_per_token(self) -> float:
        return llama_flops_per_token(self.config.model, seq_len=self.seq_len)

    def check_corpus(self, corpus: Corpus) -> None:
        vocab = self.config.model.vocab_size
        if corpus.vocab_size > vocab:
            raise ValueError(
                f"the data ({corpus.source}) has token ids up to {corpus.vocab_size - 1} but "
                f"model.vocab_size={vocab}; set model.vocab_size={corpus.vocab_size} or more."
            )
