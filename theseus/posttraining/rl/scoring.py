"""The log-probabilities of a generation batch under the model that drew it, for RL runs that
train several steps on one batch (``rl.num_iterations`` or ``rl.steps_per_generation`` > 1):
TRL's ``old_per_token_logps``, computed once, right after the rollout, in one jitted pass on the
training mesh and layouts (the parameters gathered as the step gathers them)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from theseus.model.decoder import DecoderModel
from theseus.posttraining.rl.trainer import RLTrainer
from theseus.sharding.topology import UnderMesh
from theseus.training.keys import Keys
from theseus.training.losses import row_fields, segment_positions
from theseus.training.step import jitted_scoring_pass


def logps_step(trainer: RLTrainer) -> UnderMesh:
    """Storage-layout parameters and (num, examples, RL_FIELDS, seq_len + 1) rows in, each
    target's log-probability at ``rl.temperature`` (num, examples, seq_len) out, replicated."""
    temperature = trainer.rl.temperature

    def logps(model: nnx.Module, rows: jax.Array, keys: Keys) -> jax.Array:
        assert isinstance(model, DecoderModel), type(model)  # every family's model is one
        tokens, _, segments = row_fields(rows)  # each (examples, seq_len + 1)
        segments = segments[:, :-1]  # (examples, seq_len)
        return model.sampled_logps(
            tokens[:, :-1],
            tokens[:, 1:],
            keys.examples,
            chunk=trainer.loss_chunk,
            temperature=temperature,
            segments=segments,
            positions=segment_positions(segments),
        ).logps

    return jitted_scoring_pass(trainer.context, trainer.entry, logps)


def generation_logps(
    trainer: RLTrainer, step: UnderMesh, params: Any, rows: np.ndarray
) -> np.ndarray:
    """Each target's log-probability (completions, seq_len) of a generation batch's ``rows``
    (completions, RL_FIELDS, seq_len + 1) under ``params`` (storage layout), a microbatch of
    the run's at a time."""
    examples = trainer.batch_plan.examples_per_microbatch
    batches = rows.reshape(-1, examples, *rows.shape[1:])  # (num, examples, fields, seq_len + 1)
    placed = trainer.put_batch(lambda part: batches[:, part], batches.shape)
    return np.asarray(step(params, placed)).reshape(rows.shape[0], -1)
