"""The one trainer of every model family: the family's model, plan, context and FLOPs plugged
into :class:`~theseus.training.trainer.BaseTrainer`. The registry makes one subclass per family
(:func:`trainer_class`), named as the family says (``GPTTrainer``, ``LlamaTrainer``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import pydantic
from flax import nnx

from theseus.accounting.activations import AttentionKernel, DecoderShape
from theseus.accounting.preflight import check_context_length
from theseus.data import Corpus
from theseus.model.attention import DEFAULT_BLOCK, AttentionConfig, check_backend
from theseus.model.decode import Decoder
from theseus.model.decoder import DecoderModel, TargetLogps, no_routing
from theseus.model.family import Family
from theseus.model.head import default_chunk
from theseus.training.flops import flops_per_token
from theseus.training.keys import Keys
from theseus.training.losses import (
    TokenLoss,
    masked_token_loss,
    row_fields,
    segment_positions,
    target_weights,
    with_routing,
)
from theseus.training.trainer import BaseTrainer, TrainerConfig


class FamilyTrainerConfig(TrainerConfig):
    """The shared sections plus a family's model section (:func:`trainer_class` adds it)."""

    if TYPE_CHECKING:  # each family's config class declares its own model section
        model: AttentionConfig = pydantic.Field(default_factory=AttentionConfig)


class FamilyTrainer(BaseTrainer):
    """Next-token training of a family's model (pretraining, or fine-tuning with --init-from)."""

    family: ClassVar[Family]
    config_class: ClassVar[type[FamilyTrainerConfig]]
    config: FamilyTrainerConfig

    def __init__(self, config: FamilyTrainerConfig, policy, topology=None):
        context = self.family.context(config.model)
        check_context_length(config.training, context.length, context.key)
        super().__init__(config, policy, topology)

    def build_model(self, rngs: nnx.Rngs) -> nnx.Module:
        return self.family.model_class(
            self.config.model,
            rngs=rngs,
            compute_dtype=self.compute_dtype,
            remat=self.policy.activation_checkpointing,
            lora=self.lora_spec,
        )

    def decoder(self) -> Decoder:
        """Cached decoding for ``theseus generate`` (see theseus.model.decode)."""
        return self.family.decoder(self.config.model, self.compute_dtype, self.graphdef)

    def loss(self, model: nnx.Module, tokens: jax.Array, keys: Keys, *, train: bool) -> jax.Array:
        """Next-token loss (the head and the cross-entropy a chunk at a time:
        :meth:`target_logps`); dropout (when the model has any) in training only."""
        return -self.target_logps(model, tokens, keys, train=train).logps.mean()

    def token_loss(
        self,
        model: nnx.Module,
        rows: jax.Array,
        keys: Keys,
        *,
        train: bool,
        reference: nnx.Module | None = None,
    ) -> TokenLoss:
        """Plain token rows: :meth:`loss` (which a subclass may override) times its targets, or,
        for a model with experts, the mean next-token loss of its outputs. Segmented rows
        (examples, ROW_FIELDS, seq_len + 1): each example attends within its segment at
        restarted positions, and only its trained targets count
        (:mod:`theseus.training.losses`). In training, a model with experts adds its
        load-balancing loss (:func:`~theseus.training.losses.with_routing`)."""
        assert isinstance(model, DecoderModel), type(model)  # every family's model is one
        assert reference is None, "a next-token loss has no reference model"
        if rows.ndim == 2 and model.skeleton.routing is no_routing:
            return super().token_loss(model, rows, keys, train=train)  # loss(), as overridden
        scored = self.target_logps(model, rows, keys, train=train)
        if rows.ndim == 2:
            count = rows.shape[0] * (rows.shape[1] - 1)
            mean = -scored.logps.mean()
            loss = TokenLoss(mean * count, jnp.asarray(count, jnp.int32))
        else:
            _, mask, segments = row_fields(rows)  # each (examples, seq_len + 1)
            loss = masked_token_loss(scored.logps, target_weights(mask, segments))
        return with_routing(loss, scored.routing if train else None)

    def target_logps(
        self, model: nnx.Module, rows: jax.Array, keys: Keys, *, train: bool
    ) -> TargetLogps:
        """Each next-token target's log-probability (examples, seq_len) and the routing
        statistics, of plain token rows (examples, seq_len + 1) or of segmented rows
        (examples, fields, seq_len + 1), where each example attends within its segment, at
        positions restarted at 0. The head and the loss run :attr:`loss_chunk` positions at a
        time (:func:`theseus.model.head.chunked_scores`)."""
        assert isinstance(model, DecoderModel), type(model)  # every family's model is one
        deterministic = not train
        if rows.ndim == 2:
            return model.target_logps(
                rows[:, :-1],
                rows[:, 1:],
                keys.examples,
                chunk=self.loss_chunk,
                deterministic=deterministic,
            )
        tokens, _, segments = row_fields(rows)
        inputs = segments[:, :-1]  # (examples, seq_len)
        return model.target_logps(
            tokens[:, :-1],
            tokens[:, 1:],
            keys.examples,
            chunk=self.loss_chunk,
            deterministic=deterministic,
            segments=inputs,
            positions=segment_positions(inputs),
        )

    @property
    def loss_chunk(self) -> int:
        """Positions per chunk of the loss: ``training.loss_chunk``, else
        :func:`~theseus.model.head.default_chunk` of the vocabulary and the examples per
        device."""
        vocab, examples = self.decoder_shape().vocab_size, self.batch_plan.per_device_batch_size
        return self.config.training.loss_chunk or default_chunk(vocab, examples)

    def default_seq_len(self) -> int:
        return self.family.context(self.config.model).length

    def flops_per_token(self) -> float:
        matmuls = self.family.matmuls(self.config.model)
        return flops_per_token(matmuls, seq_len=self.seq_len, loss_chunk=self.loss_chunk)

    def decoder_shape(self) -> DecoderShape:
        return self.family.shape(self.config.model)

    def attention_kernel(self) -> AttentionKernel:
        """The model's attention as the estimate models it: the written-out product for
        ``model.attention=xla`` and for dropout on the probabilities (GPT's ``model.dropout``),
        else the blockwise algorithm in the model's blocks (the fused kernels of GPUs and TPUs
        hold per-block memory as it does)."""
        model = self.config.model
        if model.attention == "xla" or model.attention_dropout > 0:
            return AttentionKernel("xla")
        block_q = model.attention_block_q or DEFAULT_BLOCK
        return AttentionKernel("blockwise", block_q, model.attention_block_k or DEFAULT_BLOCK)

    def check_backend(self) -> None:
        """An explicit fused attention kernel this backend has none of (cuDNN's off NVIDIA
        GPUs, splash off TPUs) is refused before the run writes anything (a plan may name one
        for another machine)."""
        check_backend(self.config.model.attention)

    def check_corpus(self, corpus: Corpus) -> None:
        vocab = self.decoder_shape().vocab_size
        if corpus.vocab_size > vocab:
            raise ValueError(
                f"the data ({corpus.source}) has token ids up to {corpus.vocab_size - 1} but "
                f"model.vocab_size={vocab}; set model.vocab_size={corpus.vocab_size} or more."
            )


def trainer_class(family: Family) -> type[FamilyTrainer]:
    """``family``'s trainer class, with its config class (the shared training sections plus the
    family's ``model`` section) named after it (``GPTTrainer``, ``GPTTrainerConfig``)."""
    config_class = pydantic.create_model(
        f"{family.trainer_name}Config",
        __base__=FamilyTrainerConfig,
        __module__=__name__,
        __doc__=f"{family.name} training: the shared sections plus the model's hyperparameters.",
        model=(family.config_class, pydantic.Field(default_factory=family.config_class)),
    )
    attributes = {
        "family": family,
        "config_class": config_class,
        "plan": family.plan,
        "__module__": __name__,
        "__doc__": f"Next-token training of the {family.name} family's model.",
    }
    return type(family.trainer_name, (FamilyTrainer,), attributes)
