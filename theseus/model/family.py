"""What a model family declares in its one module (``theseus/model/families/NAME.py``, which
defines ``FAMILY``): its config, model, sharding plan, context, matmul shapes (for FLOPs), cached
decoder and Hugging Face mapping. The registry (:func:`theseus.families`) imports the module and
registers the family's jobs, ``NAME/train/pretrain`` and ``NAME/evaluate``."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from flax import nnx

from theseus.accounting.activations import DecoderShape
from theseus.model.attention import AttentionConfig
from theseus.model.decode import Decoder
from theseus.sharding.axis import ShardingPlan


@dataclass(frozen=True)
class Part:
    """Indices ``[start, stop)`` of a Hugging Face tensor's dimension ``axis`` (default: its
    last, columns) are theseus parameter ``path`` (its layer ``layer`` when the parameter is
    stacked along ``n_layer``, and within it expert ``expert`` when stacked along ``n_expert``
    too)."""

    path: str
    layer: int | None
    start: int
    stop: int
    expert: int | None = None
    axis: int = -1

    @property
    def lead(self) -> tuple[int, ...]:
        """The indices of the stacked dimensions the tensor is one slice of: (), (layer,) or
        (layer, expert)."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


@dataclass(frozen=True)
class HFTensor:
    """One Hugging Face tensor: its name, shape, and the theseus parameters it is made of."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]


def whole(
    name: str,
    shape: tuple[int, ...],
    path: str,
    layer: int | None = None,
    expert: int | None = None,
) -> HFTensor:
    """A tensor that is one theseus parameter (one layer of it when ``layer`` is given, one
    expert of that layer when ``expert`` is)."""
    return HFTensor(name, shape, (Part(path, layer, 0, shape[-1], expert),))


@dataclass(frozen=True)
class Stacks:
    """How a decoder's layers are stacked: each layer's kind (``kinds``, e.g. whether it has
    experts); consecutive layers of one kind are one run, stacked along ``n_layer``. One run
    is the stack ``layers/`` itself; more are ``layers/runs/<run>/``
    (:class:`theseus.model.decoder.Runs`)."""

    kinds: tuple[bool, ...]

    @property
    def runs(self) -> tuple[tuple[bool, int], ...]:
        """Each run's kind and length, in layer order."""
        runs: list[tuple[bool, int]] = []
        for kind in self.kinds:
            same = bool(runs) and runs[-1][0] == kind
            runs = [*runs[:-1], (kind, runs[-1][1] + 1)] if same else [*runs, (kind, 1)]
        return tuple(runs)

    def place(self, layer: int) -> tuple[str, int]:
        """Layer ``layer``'s stack path and index in it."""
        if len(self.runs) == 1:
            return "layers", layer
        start = 0
        for run, (_, length) in enumerate(self.runs):
            if layer < start + length:
                return f"layers/runs/{run}", layer - start
            start += length
        raise IndexError(f"layer {layer} of {len(self.kinds)}")

    def layers(self, kind: bool) -> tuple[int, ...]:
        """The layers of ``kind``."""
        return tuple(i for i, k in enumerate(self.kinds) if k == kind)


@dataclass(frozen=True, eq=False)
class HFSpec:
    """A family's Hugging Face mapping.

    ``architectures``: the architecture of each model type the family reads and writes.
    ``from_hf(config, model_type, where)``: the theseus ``model`` section of a ``config.json``
    (a ValueError naming ``where`` and the key when theseus cannot reproduce it).
    ``export_type(model, imported)``: the model type a model section exports as (``imported``:
    the type it was imported from, or None). ``to_hf(model, model_type)``: the ``config.json``
    keys of a model section. ``tensors(model)``: the checkpoint's tensors.
    ``peft_targets``: the Hugging Face modules peft can adapt (empty: adapters are not exported).
    ``aliases(name)``: the names a tensor may have in published checkpoints.
    ``unread``: prefixes of the tensors of a folder the family leaves unread on purpose (a
    multimodal folder's vision tower); any other tensor it does not read is an error.
    ``other_layouts``: other tensor layouts of the same model that import reads (a folder in
    one of them is read in it; export writes ``tensors``).
    """

    architectures: dict[str, str]
    from_hf: Callable[[dict[str, Any], str, str], dict[str, Any]]
    export_type: Callable[[dict[str, Any], str | None], str]
    to_hf: Callable[[dict[str, Any], str], dict[str, Any]]
    tensors: Callable[[dict[str, Any]], list[HFTensor]]
    peft_targets: tuple[str, ...] = ()
    aliases: Callable[[str], tuple[str, ...]] = lambda name: (name,)
    unread: tuple[str, ...] = ()
    other_layouts: tuple[Callable[[dict[str, Any]], list[HFTensor]], ...] = ()

    def layout_of(self, model: dict[str, Any], found: Collection[str]) -> list[HFTensor]:
        """The tensors of the layout a folder holding the tensor names ``found`` is written in:
        the first whose every tensor is there (under an alias), else :attr:`tensors`."""
        layouts = [self.tensors(model), *(layout(model) for layout in self.other_layouts)]
        for tensors in layouts:
            if all(any(a in found for a in self.aliases(t.name)) for t in tensors):
                return tensors
        return layouts[0]

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.architectures)


@dataclass(frozen=True)
class Matmuls:
    """The matmul shapes of a decoder, for its FLOPs: each layer's weights that multiply
    activations ``(d_in, d_out)``, the output head's, and the width of attention's ``q kᵀ`` and
    ``probs v`` (all query heads); ``other_weights``: those of layers unlike the rest, counted
    once each (Qwen3-MoE's dense and expert MLPs when its layers are mixed)."""

    num_layers: int
    layer_weights: tuple[tuple[int, int], ...]
    head: tuple[int, int]
    attention_width: int
    other_weights: tuple[tuple[int, int], ...] = ()


def dense_matmuls(shape: DecoderShape) -> Matmuls:
    """A dense decoder's matmuls from its dimensions: q, k, v and o, the MLP's (gate and up, or
    one up projection; down), the head."""
    e, q, kv, mlp = shape.width, shape.query_width, shape.kv_width, shape.mlp_width
    up = ((e, mlp),) * (2 if shape.gated_mlp else 1)
    weights = ((e, q), (e, kv), (e, kv), (q, e), *up, (mlp, e))
    return Matmuls(shape.num_layers, weights, (e, shape.vocab_size), q)


@dataclass(frozen=True)
class Context:
    """How long a model's sequences may be: ``length`` positions (set by config ``key``)."""

    length: int
    key: str


@dataclass(frozen=True, eq=False)
class Family:
    """A model family (see the module docstring). ``model_class(config, rngs=, compute_dtype=,
    remat=, lora=)`` builds the model, whose ``__call__(tokens, keys, deterministic=)`` gives
    logits; ``decoder(config, compute_dtype, graphdef)`` its cached decoding of the parameters
    of the model ``graphdef`` (adapters and their scale included); ``shape(config)`` the
    dimensions its activation memory depends on (:mod:`theseus.accounting.activations`)."""

    name: str
    trainer_name: str
    config_class: type[AttentionConfig]
    model_class: Callable[..., nnx.Module]
    plan: ShardingPlan
    context: Callable[[Any], Context]
    matmuls: Callable[[Any], Matmuls]
    num_params: Callable[[Any], int]  # the exact parameter count of a config's model
    shape: Callable[[Any], DecoderShape]  # the dimensions its activations depend on
    decoder: Callable[[Any, Any, Any], Decoder]
    hf: HFSpec
    descriptions: dict[str, str] = field(default_factory=dict)  # job suffix -> description
