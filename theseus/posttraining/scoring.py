"""The log-probabilities of a generation batch under the model that drew it, for RL runs that
train several steps on one batch (``rl.num_iterations`` or ``rl.steps_per_generation`` > 1):
TRL's ``old_per_token_logps``, computed once, right after the rollout, in one jitted pass on the
training mesh and layouts (the parameters gathered as the step gathers them)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.posttraining.trainer import RLTrainer
from theseus.sharding.topology import UnderMesh
from theseus.training import gathering
from theseus.training.keys import validation_keys
from theseus.training.losses import row_fields, segment_positions
from theseus.training.step import batch_sharding


def logps_step(trainer: RLTrainer) -> UnderMesh:
    """Storage-layout parameters and (num, examples, RL_FIELDS, seq_len + 1) rows in, each
    target's log-probability at ``rl.temperature`` (num, examples, seq_len) out, replicated."""
    context, entry, rl = trainer.context, trainer.entry, trainer.rl

    def run(params: Any, batches: jax.Array) -> jax.Array:
        params = jax.lax.with_sharding_constraint(params, entry.layout)
        keys = validation_keys(batches.shape[:2])

        def one(carry: None, inputs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
            rows, examples = inputs
            tokens, _, segments = row_fields(rows)  # each (examples, seq_len + 1)
            segments = segments[:, :-1]  # (examples, seq_len)

            def logps(params: Any) -> jax.Array:
                model = nnx.merge(context.graphdef, params)
                return model.sampled_logps(
                    tokens[:, :-1],
                    tokens[:, 1:],
                    examples,
                    chunk=trainer.loss_chunk,
                    temperature=rl.temperature,
                    segments=segments,
                    positions=segment_positions(segments),
                ).logps

            return None, gathering.loss_with_layouts(
                logps,
                params,
                context.layouts,
                None,
                cast_dtype=context.gather_dtype,
                remat=context.policy.activation_checkpointing,
                experts=context.policy.experts,
            )

        return jax.lax.scan(one, None, (batches, keys.examples))[1]

    step = jax.jit(
        run,
        in_shardings=(context.layouts.storage, batch_sharding(context.mesh)),
        out_shardings=NamedSharding(context.mesh, P()),
    )
    return UnderMesh(step, context.topology.device_mesh)


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
