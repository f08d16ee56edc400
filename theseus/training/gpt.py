"""The GPT trainer: the GPT model and plan plugged into BaseTrainer."""

from __future__ import annotations

from typing import ClassVar

import jax
import pydantic
from flax import nnx

from theseus.accounting.preflight import check_context_length
from theseus.data import Corpus
from theseus.model import GPT, GPT_PLAN, GPTConfig
from theseus.model.gpt_decode import GPTDecoder
from theseus.sharding.axis import ShardingPlan
from theseus.training.flops import gpt_flops_per_token
from theseus.training.keys import Keys
from theseus.training.trainer import BaseTrainer, TrainerConfig, next_token_loss


class GPTTrainerConfig(TrainerConfig):
    """GPT pretraining: the shared training sections plus the model's hyperparameters."""

    model: GPTConfig = pydantic.Field(default_factory=GPTConfig)


class GPTTrainer(BaseTrainer):
    """Next-token pretraining of :class:`GPT` on byte or token data."""

    config_class: ClassVar[type[TrainerConfig]] = GPTTrainerConfig
    plan: ClassVar[ShardingPlan] = GPT_PLAN

    def __init__(self, config: GPTTrainerConfig, policy, topology=None):
        check_context_length(config.training, config.model.block_size, "model.block_size")
        super().__init__(config, policy, topology)

    def build_model(self, rngs: nnx.Rngs) -> GPT:
        return GPT(
            self.config.model,
            rngs=rngs,
            compute_dtype=self.compute_dtype,
            remat=self.policy.activation_checkpointing,
            lora=self.lora_spec,
        )

    def decoder(self) -> GPTDecoder:
        """Cached decoding for ``theseus generate`` (see theseus.model.decode)."""
        spec = self.lora_spec
        return GPTDecoder(
            self.config.model, self.compute_dtype, 0.0 if spec is None else spec.scale
        )

    def loss(self, model: GPT, tokens: jax.Array, keys: Keys, *, train: bool) -> jax.Array:
        """Next-token loss; dropout (``model.dropout``) in training only, one key per example."""
        logits = model(tokens[:, :-1], keys.examples, deterministic=not train)
        return next_token_loss(logits, tokens[:, 1:])

    def default_seq_len(self) -> int:
        return self.config.model.block_size

    def flops_per_token(self) -> float:
        m = self.config.model
        return gpt_flops_per_token(
            n_layer=m.n_layer,
            n_embd=m.n_embd,
            n_attn=m.n_attn,
            n_mlp=m.n_mlp,
            vocab_size=m.vocab_size,
            seq_len=self.seq_len,
        )

    def check_corpus(self, corpus: Corpus) -> None:
        vocab = self.config.model.vocab_size
        if corpus.vocab_size > vocab:
            raise ValueError(
                f"the data ({corpus.source}) has token ids up to {corpus.vocab_size - 1} but "
                f"model.vocab_size={vocab}; set model.vocab_size={corpus.vocab_size} or more."
            )
