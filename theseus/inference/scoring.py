"""Log-likelihoods of continuations, in batches of a few fixed shapes, under any layout.

A request is a context and a continuation, as token ids. Its tokens (the last ``context_len + 1``
when longer, as the evaluation harness truncates) are scored by one forward pass whose float32
logits give the continuation's summed log-probability and whether greedy decoding would produce
it. A family's model runs the head as training's loss does, a chunk of positions at a time
(:func:`theseus.model.head.chunked_scores` with :func:`~theseus.model.head.scores_of_logits`; ``training.loss_chunk``, else
:func:`~theseus.model.head.default_chunk` of the rows a device scores), so no logits (rows,
width, vocab) exist and any context that trains can be scored. Requests are sorted by length
and cut into batches of ``rows`` (idle rows fill the last); each batch is right-padded to the
smallest of a few widths (powers of two up to the context), so a whole evaluation compiles at
most one program a width. The parameters stay in their storage layout (each layer gathered
inside the layer scan, as in training): under FSDP the model is never whole on a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.config import check_int
from theseus.inference.logits import with_model
from theseus.inference.programs import Program, ProgramCache, global_array
from theseus.model.decoder import DecoderModel
from theseus.model.head import ScoredTargets, default_chunk, scores_of_logits
from theseus.sharding.axis import Axis
from theseus.sharding.layout import abstract_with
from theseus.training.trainer import BaseTrainer

#: The narrowest batch width; wider ones double up to the model's context.
MIN_WIDTH = 32


@dataclass(frozen=True)
class Score:
    """A continuation's summed log-probability and whether greedy decoding produces it."""

    logprob: float
    is_greedy: bool


def bucket_widths(context_len: int) -> list[int]:
    """The batch widths: powers of two from :data:`MIN_WIDTH`, then the context itself."""
    widths = [w for w in (MIN_WIDTH * 2**i for i in range(32)) if w < context_len]
    return [*widths, context_len]


def scored_window(context: Sequence[int], continuation: Sequence[int], context_len: int):
    """The model's input (the tokens before the last, at most ``context_len``) and the
    continuation's length: the tokens kept are the last ``context_len + 1``."""
    if not context or not continuation:
        raise ValueError("a scored request needs at least one context and one continuation token")
    if len(continuation) > context_len:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens is longer than the model's context of "
            f"{context_len}; it cannot be scored in one pass"
        )
    kept = [*context, *continuation][-(context_len + 1) :]
    return kept, len(continuation)


class Scorer:
    """A trainer's model with storage-layout parameters, scoring requests in fixed shapes."""

    def __init__(self, trainer: BaseTrainer, params: Any, *, rows_per_replica: int = 4):
        check_int("rows_per_replica", rows_per_replica, minimum=1)
        self.trainer = trainer
        self.params = params
        decoder = trainer.decoder()
        if decoder is None:
            raise TypeError(
                f"{type(trainer).__name__} cannot be scored: its decoder() returns None, so its "
                "context length is unknown; override it (theseus.model.decode.Decoder)"
            )
        self.context_len = decoder.context_len
        self.vocab_size = decoder.vocab_size
        self.rows = rows_per_replica * trainer.topology.replicas
        loss_chunk = trainer.config.training.loss_chunk
        self.chunk = loss_chunk or default_chunk(self.vocab_size, rows_per_replica)
        self.widths = bucket_widths(self.context_len)
        self._programs = ProgramCache(trainer.topology.device_mesh)  # by width

    @property
    def num_programs(self) -> int:
        """Programs compiled so far (one a batch width used)."""
        return len(self._programs)

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Score]:
        """One :class:`Score` a (context ids, continuation ids) request, in request order."""
        windows = [scored_window(c, t, self.context_len) for c, t in requests]
        for kept, _ in windows:
            outside = [i for i in kept if not 0 <= i < self.vocab_size]
            if outside:
                raise ValueError(
                    f"token id {outside[0]} lies outside the model's vocabulary of "
                    f"{self.vocab_size}; the tokenizer does not match the run"
                )
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        scores: list[Score | None] = [None] * len(windows)
        for start in range(0, len(order), self.rows):
            chunk = order[start : start + self.rows]
            logprobs, greedy = self._run([windows[i] for i in chunk])
            for row, index in enumerate(chunk):
                scores[index] = Score(float(logprobs[row]), bool(greedy[row]))
        done = [score for score in scores if score is not None]
        assert len(done) == len(scores)  # every request was in one chunk
        return done

    def _run(self, windows: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray]:
        longest = max(len(kept) - 1 for kept, _ in windows)
        width = next(w for w in self.widths if w >= longest)
        tokens = np.zeros((self.rows, width), np.int32)  # (rows, width) inputs
        targets = np.zeros((self.rows, width), np.int32)  # (rows, width): the next tokens
        scored = np.zeros((self.rows, width), bool)  # (rows, width): continuation positions
        for row, (kept, num_scored) in enumerate(windows):
            length = len(kept) - 1
            tokens[row, :length] = kept[:-1]
            targets[row, :length] = kept[1:]
            scored[row, length - num_scored : length] = True
        program = self.program(width)
        sharding = NamedSharding(self.trainer.mesh, P(Axis.BATCH, None))
        inputs = [global_array(a, sharding) for a in (tokens, targets, scored)]
        logprobs, greedy = program(self.params, *inputs)
        return np.asarray(jax.device_get(logprobs)), np.asarray(jax.device_get(greedy))

    def program(self, width: int) -> jax.stages.Compiled:
        """The compiled program that scores batches of ``width`` positions (compiled at its
        first use)."""
        (program,) = self._programs(width, lambda: (self._program_for(width),))
        return program

    def _program_for(self, width: int) -> Program:
        trainer, chunk = self.trainer, self.chunk

        def score(params, tokens, targets, scored):
            scores = with_model(
                trainer, params, lambda model: scored_targets(model, tokens, targets, chunk)
            )  # (rows, width) each
            total = jnp.sum(jnp.where(scored, scores.logps, 0.0), axis=-1)  # (rows,)
            return total, jnp.all(scores.greedy | ~scored, axis=-1)

        rows = NamedSharding(trainer.mesh, P(Axis.BATCH, None))
        replicated = NamedSharding(trainer.mesh, P())
        params = abstract_with(trainer.abstract_state.params, trainer.layouts.storage)
        ints = jax.ShapeDtypeStruct((self.rows, width), jnp.int32, sharding=rows)
        flags = jax.ShapeDtypeStruct((self.rows, width), jnp.bool_, sharding=rows)
        return Program(score, (params, ints, ints, flags), (replicated, replicated))


def scored_targets(model: Any, tokens: jax.Array, targets: jax.Array, chunk: int) -> ScoredTargets:
    """Each of ``targets``' log-probability and greedy flag (rows, width) after int ``tokens``
    (rows, width): a family's model runs its head ``chunk`` positions at a time; any other
    model gives its whole logits (rows, width, vocab), which are scored at once."""
    if isinstance(model, DecoderModel):
        return model.scored_targets(tokens, targets, chunk=chunk)
    return scores_of_logits(model(tokens), targets)
