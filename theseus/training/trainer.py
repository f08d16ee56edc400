"""BaseTrainer: what a model needs to train under any policy: its config, abstract model, layouts,
pre-flight check and sharded state, and the :class:`~theseus.training.context.TrainerContext` its
steps (:mod:`theseus.training.step`) read.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydantic
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.accounting.activations import AttentionKernel, DecoderShape
from theseus.accounting.memory import (
    CompiledStep,
    MemoryTotals,
    device_bytes,
    model_state_totals,
    shard_bytes,
)
from theseus.accounting.preflight import preflight
from theseus.config import (
    CheckpointingConfig,
    DataConfig,
    EvaluationConfig,
    LoggingConfig,
    OptimizationConfig,
    Section,
    TrainingConfig,
)
from theseus.data import Corpus, Mixture
from theseus.model.decode import Decoder
from theseus.model.lora import LoraSpec
from theseus.sharding.axis import PHASES, ShardingPlan, ShardingPolicy
from theseus.sharding.layout import (
    AbstractLeaf,
    Layouts,
    abstract_leaves,
    check_layouts,
    optimizer_layout,
    resolve_layouts,
)
from theseus.sharding.topology import Topology, UnderMesh
from theseus.training import gathering, optimizer, step
from theseus.training.context import TrainerContext
from theseus.training.finetune import FinetuneConfig, lora_spec, partition
from theseus.training.keys import Keys
from theseus.training.losses import TokenLoss, next_token_loss, zero_token_loss
from theseus.training.state import TrainState, reference_of, train_state

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class TrainerConfig(Section):
    """The components every trainer shares; a trainer's config adds a ``model`` section."""

    training: TrainingConfig = pydantic.Field(default_factory=TrainingConfig)
    optimization: OptimizationConfig = pydantic.Field(default_factory=OptimizationConfig)
    data: DataConfig = pydantic.Field(default_factory=DataConfig)
    logging: LoggingConfig = pydantic.Field(default_factory=LoggingConfig)
    checkpointing: CheckpointingConfig = pydantic.Field(default_factory=CheckpointingConfig)
    finetune: FinetuneConfig = pydantic.Field(default_factory=FinetuneConfig)
    evaluation: EvaluationConfig = pydantic.Field(default_factory=EvaluationConfig)
    if TYPE_CHECKING:  # each trainer's config class declares its own model section
        model: Section = pydantic.Field(default_factory=Section)


class BaseTrainer(abc.ABC):
    """Trains an annotated NNX model under any :class:`ShardingPolicy` with the same numbers.

    A subclass names its config class and plan and builds its model; the base class does the
    rest: abstract state, layouts, the pre-flight check, sharded initialisation and the steps.
    Constructing a trainer allocates nothing; :meth:`init_state` creates the state in its layouts.
    What the steps need is one frozen value built here, :attr:`context`.
    """

    config_class: ClassVar[type[TrainerConfig]] = TrainerConfig
    plan: ClassVar[ShardingPlan]

    def __init__(
        self, config: TrainerConfig, policy: ShardingPolicy, topology: Topology | None = None
    ):
        if not isinstance(getattr(type(self), "plan", None), ShardingPlan):
            raise TypeError(
                f"{type(self).__name__} must set the class attribute `plan` to its model's "
                "ShardingPlan"
            )
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got "
                f"{type(config).__name__}"
            )
        self.config = config
        self.policy = policy
        self.topology = topology if topology is not None else Topology.new(policy)
        if self.topology.policy.tp != policy.tp:
            raise ValueError(
                f"topology was built for tp={self.topology.policy.tp} but the policy has "
                f"tp={policy.tp}"
            )
        self.mesh = self.topology.mesh
        self.graphdef, self.abstract_params = self._build_abstract_model()
        leaves = abstract_leaves(self.abstract_params)[0]
        self.partition = partition(leaves, config.finetune, type(self).__name__)
        self.optimizer = self.build_optimizer()
        self.batch_plan = preflight(
            self.abstract_params, self.plan, policy, self.topology, config.training, self.seq_len
        )
        self.layouts = self._resolve_layouts(policy, self.mesh)
        # From the parameters' shapes: the model is not traced again (only the optimizer's init),
        # and nothing runs on a device (the key too is traced).
        self.abstract_state: TrainState = jax.eval_shape(
            lambda params: self._state_of(params, jax.random.PRNGKey(0)),
            nnx.to_pure_dict(self.abstract_params),
        )
        replicated = NamedSharding(self.mesh, P())
        opt_layout = self._optimizer_layout(self.layouts.update, self.mesh)
        reference_layout = self.layouts.storage if self.holds_reference else None
        self.state_layout = train_state(
            self.layouts.storage, opt_layout, replicated, replicated, reference_layout
        )
        self.context = TrainerContext(
            topology=self.topology,
            policy=policy,
            graphdef=self.graphdef,
            abstract_state=self.abstract_state,
            layouts=self.layouts,
            state_layout=self.state_layout,
            partition=self.partition,
            optimizer=self.optimizer,
            learning_rate=self.learning_rate(),
            batch_plan=self.batch_plan,
            seq_len=self.seq_len,
            loss=self.loss,
            token_loss=self.token_loss,
            zero_loss=self.zero_loss,
            gather_dtype=gathering.gather_dtype(self.compute_dtype, config.training.gather_dtype),
        )

    # --- what a subclass provides ------------------------------------------------------------

    @abc.abstractmethod
    def build_model(self, rngs: nnx.Rngs) -> nnx.Module:
        """The model, built from ``self.config``; its weights carry logical names."""

    def default_seq_len(self) -> int:
        """Tokens per example when ``training.seq_len`` is not set."""
        raise ValueError(
            f"{type(self).__name__} has no default sequence length; set training.seq_len"
        )

    def flops_per_token(self) -> float | None:
        """Training FLOPs (forward and backward) per token, for MFU; None: XLA counts them."""
        return None

    def decoder_shape(self) -> DecoderShape | None:
        """The dimensions the model's activation memory depends on, for ``theseus plan``
        (:mod:`theseus.accounting.activations`); None: not a decoder the planner knows (then
        ``theseus plan --compile`` measures its activations)."""
        return None

    def attention_kernel(self) -> AttentionKernel:
        """The attention kernel the model's layers run, for the activation estimate."""
        return AttentionKernel("xla")

    @property
    def loss_chunk(self) -> int | None:
        """Positions of a row whose logits the loss computes at once, for the activation
        estimate (None: the whole sequence, as :meth:`loss` reads the model's logits)."""
        return None

    def check_backend(self) -> None:
        """Reject, before a run writes anything, what this process's backend cannot run
        (nothing unless a subclass says otherwise)."""
        return None

    def check_corpus(self, corpus: Corpus) -> None:
        """Reject data the model cannot read (e.g. token ids beyond its vocabulary)."""
        del corpus  # any data is fine unless a subclass says otherwise

    def loss(self, model: nnx.Module, tokens: jax.Array, keys: Keys, *, train: bool) -> jax.Array:
        """The mean loss of ``model`` on ``tokens`` (examples, seq_len + 1): next-token prediction
        unless a subclass overrides it; ``keys`` are the examples' random keys, ``train`` is False
        in validation. The one loss of a trainer on plain token rows: the step and validation
        call it through :meth:`token_loss`, FLOP counting directly."""
        del keys, train
        return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])

    def token_loss(
        self,
        model: nnx.Module,
        rows: jax.Array,
        keys: Keys,
        *,
        train: bool,
        reference: nnx.Module | None = None,
    ) -> TokenLoss:
        """The :class:`TokenLoss` of ``model`` on ``rows``, what the step and validation add up.
        Here: :meth:`loss` (a mean over every next-token target) times the number of targets,
        for plain token rows (examples, seq_len + 1). Packed rows of masked data
        (examples, ROW_FIELDS, seq_len + 1) need a trainer whose ``token_loss`` reads their
        segments and masks (the family trainers do). ``reference``: the model of the state's
        reference copy, which only a trainer that :attr:`holds_reference` gets."""
        assert reference is None, "a next-token loss has no reference model"
        if rows.ndim != 2:
            raise TypeError(
                f"{type(self).__name__} trains on plain token rows (examples, seq_len + 1), got "
                f"rows of shape {rows.shape}; masked or document-masked data needs a trainer "
                "that defines token_loss for segmented rows (the model families' trainers do)"
            )
        count = rows.shape[0] * (rows.shape[1] - 1)
        mean = self.loss(model, rows, keys, train=train)
        return TokenLoss(mean * count, jnp.asarray(count, jnp.int32))

    def rows_of(self, mixture: Mixture) -> Mixture:
        """The run's data as this trainer reads it (a preference trainer: as pairs); as loaded
        unless a subclass says otherwise."""
        return mixture

    def with_reference(self, mixture: Mixture, params: Any, run_dir: Path) -> Mixture:
        """``mixture`` with what the loss needs computed from the starting ``params`` before
        training (a preference run's reference log-probabilities, kept in ``run_dir``); nothing
        unless a subclass says otherwise."""
        del params, run_dir
        return mixture

    def for_evaluation(self, mixture: Mixture, params: Any, run_dir: Path) -> Mixture:
        """``mixture`` as ``theseus evaluate`` of ``run_dir``'s ``params`` reads it (a preference
        run: with the reference); as loaded unless a subclass says otherwise."""
        del params, run_dir
        return mixture

    def zero_loss(self) -> TokenLoss:
        """The sum of :meth:`token_loss` over no rows: what the steps start adding from (its
        structure is ``token_loss``'s on the run's rows)."""
        return zero_token_loss()

    def decoder(self) -> Decoder | None:
        """Cached decoding for ``theseus generate`` (:class:`theseus.model.decode.Decoder`);
        None when the model cannot generate."""
        return None

    # --- derived facts -----------------------------------------------------------------------

    @cached_property
    def seq_len(self) -> int:
        return self.config.training.seq_len or self.default_seq_len()

    @property
    def compute_dtype(self) -> jnp.dtype:
        return COMPUTE_DTYPES[self.config.training.dtype]

    def _build_abstract_model(self) -> tuple[nnx.GraphDef, nnx.State]:
        """The model's graph and its parameters as shapes with logical names (no allocation)."""
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(lambda: self.build_model(nnx.Rngs(0)))
        graphdef, params, *others = nnx.split(model, nnx.Param, ...)
        (rest,) = others
        if jax.tree.leaves(rest):
            raise ValueError(
                f"{type(model).__name__} has state that is not nnx.Param "
                f"({sorted(str(p) for p, _ in nnx.to_flat_state(rest))[:5]}); theseus trains "
                "models whose variables are all nnx.Param."
            )
        return graphdef, params

    @cached_property
    def abstract_leaves(self) -> list[AbstractLeaf]:
        """The parameters' paths, shapes, dtypes as stored (frozen ones in frozen_dtype), names."""
        frozen, dtype = self.partition.frozen, np.dtype(self.frozen_dtype)
        leaves = abstract_leaves(self.abstract_params)[0]
        return [replace(x, dtype=dtype) if x.path in frozen else x for x in leaves]

    @cached_property
    def num_params(self) -> int:
        return sum(math.prod(leaf.shape) for leaf in self.abstract_leaves)

    def learning_rate(self) -> optax.Schedule:
        return optimizer.learning_rate(self.config.optimization, self.config.training.steps)

    def build_optimizer(self) -> optax.GradientTransformation:
        names = optimizer.decay_mask(
            lambda: {leaf.path: leaf.names for leaf in self.abstract_leaves}
        )
        return optimizer.adamw(self.config.optimization, self.learning_rate(), names)

    @property
    def lora_spec(self) -> LoraSpec | None:
        """The LoRA adapters ``finetune`` asks for: pass it to the model (``lora=``)."""
        return lora_spec(self.config.finetune)

    @property
    def frozen_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.config.finetune.frozen_dtype or self.config.training.dtype)

    def execution_facts(self) -> dict[str, Any]:
        """Policy, mesh and batch accounting, as run records and checkpoints store them."""
        plan = self.batch_plan
        return {
            "policy": self.policy.model_dump(),
            "mesh_shape": self.topology.mesh_shape,
            "num_devices": self.topology.num_devices,
            "num_processes": self.topology.num_processes,
            "replicas": plan.replicas,
            "per_device_batch_size": plan.per_device_batch_size,
            "accumulation_steps": plan.accumulation_steps,
            "global_batch_size": plan.global_batch_size,
            "seq_len": plan.seq_len,
        }

    # --- the state ---------------------------------------------------------------------------

    def _init_fn(self, seed: jax.Array | int) -> TrainState:
        init_key, rng = jax.random.split(jax.random.PRNGKey(seed))
        with nnx.use_eager_sharding(False):
            model = self.build_model(nnx.Rngs(params=init_key))
        return self._state_of(nnx.to_pure_dict(nnx.state(model, nnx.Param)), rng)

    def _state_of(self, params: Any, rng: jax.Array) -> TrainState:
        """The starting state around the model's freshly built ``params``."""
        params = self.partition.cast_frozen(params, self.frozen_dtype)
        opt_state = self.optimizer.init(self.partition.trained(params))  # none for frozen ones
        reference = params if self.holds_reference else None  # a copy: jit's outputs are distinct
        return train_state(params, opt_state, jnp.zeros((), jnp.int32), rng, reference)

    @property
    def holds_reference(self) -> bool:
        """Whether the state holds a frozen copy of the starting parameters
        (:class:`~theseus.training.state.ReferencedState`) that the loss reads as its reference model: no, unless a
        subclass says so (a full fine-tuning preference run with the live reference)."""
        return False

    def with_reference_params(self, state: TrainState) -> TrainState:
        """``state`` whose reference (where it holds one) is a copy of its parameters, in their
        storage layout: the start of a run whose parameters were replaced (``--init-from``)."""
        if reference_of(state) is None:
            return state
        copy = jax.jit(lambda params: params, out_shardings=self.layouts.storage)
        with jax.set_mesh(self.topology.device_mesh):
            reference = copy(state.params)  # new buffers, not the params'
        return train_state(state.params, state.opt_state, state.step, state.rng, reference)

    def _resolve_layouts(self, policy: ShardingPolicy, mesh: Mesh | AbstractMesh) -> Layouts:
        annotated = resolve_layouts(self.abstract_params, self.plan, policy, mesh)
        return Layouts(*(nnx.to_pure_dict(annotated[p]) for p in PHASES))

    def _optimizer_layout(self, update_layout: Any, mesh: Mesh | AbstractMesh) -> Any:
        update_layout = self.partition.trained(update_layout)
        return optimizer_layout(self.optimizer, self.abstract_state.opt_state, update_layout, mesh)

    def init_state(self, seed: int | None = None) -> TrainState:
        """Create the state directly in its layouts; it is never whole on one device."""
        seed = self.config.training.seed if seed is None else seed
        with jax.set_mesh(self.topology.device_mesh):
            return self._init_program(seed)

    @cached_property
    def _init_program(self) -> Callable[[int], TrainState]:
        """The jitted initialisation, traced once per trainer (the seed is an argument)."""
        return jax.jit(self._init_fn, out_shardings=self.state_layout)

    def memory(
        self, policy: ShardingPolicy | None = None, mesh: Mesh | AbstractMesh | None = None
    ) -> MemoryTotals:
        """Per-device model-state bytes predicted from this trainer's layouts; with ``policy``
        and/or ``mesh`` (real or abstract), from the layouts they would give after the same
        layout check (raises :class:`~theseus.sharding.layout.LayoutError`). No trainer is built."""
        if policy is None and mesh is None:
            storage, opt_layout = self.layouts.storage, self.state_layout.opt_state
        else:
            policy = self.policy if policy is None else policy
            mesh = self.mesh if mesh is None else mesh
            check_layouts(self.abstract_params, self.plan, policy, mesh)
            layouts = self._resolve_layouts(policy, mesh)
            storage, opt_layout = layouts.storage, self._optimizer_layout(layouts.update, mesh)
        params, trained = self.abstract_state.params, self.partition.trained
        opt_state = self.abstract_state.opt_state
        totals = model_state_totals(
            params, opt_state, storage, opt_layout, trained=(trained(params), trained(storage))
        )
        if reference_of(self.abstract_state) is None:
            return totals
        copy = shard_bytes(reference_of(self.abstract_state), storage)  # one more params copy
        return replace(totals, params=totals.params + copy)

    def measured_memory(self, state: TrainState) -> MemoryTotals:
        """Bytes of ``state`` on this process's first device of the mesh (no gradient
        accumulator: it exists only inside the step)."""
        here = jax.process_index()
        devices = self.topology.device_mesh.devices.flat
        device = next(d for d in devices if d.process_index == here)
        return MemoryTotals(
            params=device_bytes((state.params, reference_of(state)), device),
            grad_accumulator=0,
            optimizer=device_bytes(state.opt_state, device),
        )

    # --- the steps (:mod:`theseus.training.step`, on :attr:`context`) ------------------------

    @property
    def batch_sharding(self) -> NamedSharding:
        return step.batch_sharding(self.mesh)

    @cached_property
    def per_layer_paths(self) -> frozenset[str]:
        """Parameters gathered one layer at a time inside the layer scan (one abstract trace)."""
        return step.per_layer_paths(self.context)

    @cached_property
    def entry(self) -> gathering.Entry:
        return gathering.entry(self.context, lambda: self.per_layer_paths)

    @cached_property
    def train_step(self) -> UnderMesh:
        """One jitted step: state donated, explicit in/out shardings."""
        return step.jitted_train_step(self.context, self.entry)

    @cached_property
    def validation_step(self) -> UnderMesh:
        """Mean loss over the trained tokens of (num_batches, examples, ...) rows."""
        return step.jitted_validation_step(self.context, self.entry)

    def compile(self, batch_shape: tuple[int, ...] | None = None) -> CompiledStep:
        """The train step compiled ahead of time for this mesh (nothing allocated) for batches
        of ``batch_shape`` (default: the plan's plain token rows)."""
        shape = self.batch_plan.shape if batch_shape is None else batch_shape
        return step.compile_train_step(self.context, self.train_step, shape)

    def put_batch(
        self, rows_for: Callable[[slice], np.ndarray], shape: tuple[int, ...]
    ) -> jax.Array:
        """A global batch array whose devices each read only their own example rows."""
        return step.put_batch(self.mesh, rows_for, shape)
