"""``theseus import-hf``: a Hugging Face checkpoint folder becomes a theseus run directory.

Every check runs before anything is written: the config (model type, architecture, settings),
every tensor's presence and shape, the files' sizes. Then each parameter is built shard by shard
in the storage layout of the chosen policy: for each distinct shard, the slices it needs are read
from the memory-mapped safetensors files (each layer's tensor, or GPT-2's q/k/v columns of
``c_attn``), converted to float32 and put on the devices that hold that shard, so a parameter is
never whole on the host (unless its layout keeps it whole) and each process reads only the
slices of its own devices. The run directory holds a checkpoint of the parameters (step 0, with
the job and model config in its metadata), ``config.yaml``, ``run.json`` and the tokenizer files.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from theseus.checkpoint.checkpointer import Checkpointer
from theseus.checkpoint.meta import CheckpointMeta
from theseus.config import CHECKPOINTS, apply_overrides, save_yaml, validate
from theseus.distributed.supervise import log_path
from theseus.hf.config import ModelSpec, read_config
from theseus.hf.safetensors import TensorInfo, checkpoint_tensors
from theseus.jobs import get_job
from theseus.model.family import HFTensor, Part
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import is_sharding, path_str
from theseus.sharding.topology import Topology
from theseus.tokenization.folder import TOKENIZER_FILES
from theseus.training.run.identity import copy_tokenizer_files
from theseus.training.trainer import BaseTrainer

logger = logging.getLogger(__name__)

IMPORTED_FROM = "imported_from"  # run.json: the Hugging Face model an import came from


@dataclass(frozen=True)
class ImportResult:
    """What ``import_hf`` wrote: the run directory, its job, parameter count and source."""

    out_dir: str
    job: str
    model_type: str
    num_params: int
    dtype: str
    tokenizer_files: list[str]

    def describe(self) -> str:
        return (
            f"imported {self.model_type} ({self.num_params:,} parameters, {self.dtype}) as job "
            f"{self.job} into {self.out_dir}"
        )


def read_spec(hf_dir: Path) -> ModelSpec:
    """The model of the Hugging Face model folder ``hf_dir`` (its ``config.json``)."""
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} holds no config.json: it is not a Hugging Face model folder")
    return read_config(hf_dir)


def import_trainer(
    spec: ModelSpec, policy: ShardingPolicy, devices: Sequence[jax.Device] | None
) -> BaseTrainer:
    """The job's trainer for the model, with a batch accounting that fits any mesh."""
    trainer_class = get_job(spec.job).trainer_class
    topology = Topology.new(policy, devices)
    config = validate(trainer_class.config_class, {"model": spec.model})
    config = apply_overrides(
        config, [f"training.batch_size={topology.replicas}", "training.per_device_batch_size=1"]
    )
    return trainer_class(config, policy, topology)


def match_tensors(
    expected: list[HFTensor],
    found: dict[str, TensorInfo],
    hf_dir: Path,
    aliases: Callable[[str], tuple[str, ...]],
    unread: tuple[str, ...] = (),
) -> dict[str, TensorInfo]:
    """Each expected tensor's file entry (under one of its ``aliases``); a missing or misshapen
    one is an error naming it, and so is a tensor of the folder that nothing reads (unless its
    name starts with one of the ``unread`` prefixes)."""
    matched, problems = {}, []
    for tensor in expected:
        info = next((found[a] for a in aliases(tensor.name) if a in found), None)
        if info is None:
            problems.append(f"{tensor.name} is missing (expected shape {tensor.shape})")
        elif info.shape != tensor.shape:
            problems.append(
                f"{tensor.name} in {info.file.name} has shape {info.shape}, config.json implies "
                f"{tensor.shape}"
            )
        else:
            matched[tensor.name] = info
    read = {a for tensor in expected for a in aliases(tensor.name)}
    left = sorted(name for name in found if name not in read and not name.startswith(unread))
    problems += [f"{name} is not a tensor of the model config.json describes" for name in left]
    if problems:
        raise ValueError(
            f"{hf_dir}: {len(problems)} tensor(s) do not fit its config.json: "
            + "; ".join(problems[:5])
        )
    return matched


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[range]:
    return [range(*s.indices(size)) for s, size in zip(index, shape, strict=True)]


def read_shard(
    parts: dict[tuple[int, ...], tuple[Part, TensorInfo]],
    shape: tuple[int, ...],
    index: tuple[slice, ...],
) -> np.ndarray:
    """One shard (``index`` of a parameter of ``shape``) as float32, read from the memory-mapped
    tensors (``parts`` by :attr:`Part.lead`): for a parameter stacked along layers (and
    experts), the slices of each layer (and expert) in the shard's range."""
    depth = len(next(iter(parts)))  # the stacked dimensions: 0, 1 (layers) or 2 (and experts)

    def piece(part: Part, info: TensorInfo, dims: list[range]) -> np.ndarray:
        where = [slice(d.start, d.stop) for d in dims]
        along = dims[part.axis]  # the part's own indices of the tensor's dimension `axis`
        where[part.axis] = slice(part.start + along.start, part.start + along.stop)
        return np.asarray(info.array()[tuple(where)], dtype=np.float32)

    def stack(lead: tuple[int, ...], dims: list[range]) -> np.ndarray:
        if len(lead) == depth:
            return piece(*parts[lead], dims)
        pieces = [stack((*lead, i), dims[1:]) for i in dims[0]]
        return np.stack(pieces) if pieces else np.zeros([len(r) for r in dims], np.float32)

    return stack((), _index(index, shape))


def place(
    shape: tuple[int, ...], sharding: NamedSharding, read: Callable[[tuple], np.ndarray]
) -> jax.Array:
    """A global array in ``sharding`` whose shards are read one distinct shard at a time and
    put on this process's devices that hold it (host memory: one shard)."""
    by_index: dict[tuple, list[jax.Device]] = defaultdict(list)
    indices = sharding.addressable_devices_indices_map(shape)
    for device, index in indices.items():
        assert index is not None  # an array, not a scalar: every device holds slices
        key = tuple((s.start, s.stop) for s in index)
        by_index[key].append(device)
    arrays = {}
    for devices in by_index.values():
        host = read(indices[devices[0]] or ())
        for device in devices:
            arrays[device] = jax.device_put(host, device)
        del host
    ordered = [arrays[d] for d in indices]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered)


def read_params(trainer: BaseTrainer, tensors: list[HFTensor], infos: dict[str, TensorInfo]):
    """Every parameter in the trainer's storage layout, read shard by shard."""
    parts: dict[str, dict[tuple[int, ...], tuple[Part, TensorInfo]]] = defaultdict(dict)
    for tensor in tensors:
        for part in tensor.parts:
            parts[part.path][part.lead] = (part, infos[tensor.name])
    flat = jax.tree_util.tree_flatten_with_path(trainer.abstract_state.params)[0]
    shardings = jax.tree.leaves(trainer.layouts.storage, is_leaf=is_sharding)
    leaves = []
    for (path, leaf), sharding in zip(flat, shardings, strict=True):
        name = path_str(path)
        own = parts[name]
        assert own, f"no Hugging Face tensor maps to {name}"

        def read(index, own=own, shape=leaf.shape):
            return read_shard(own, shape, index)

        leaves.append(place(tuple(leaf.shape), sharding, read))
    return jax.tree.unflatten(jax.tree.structure(trainer.abstract_state.params), leaves)


def _dtype_name(info: TensorInfo) -> str:
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(str(info.dtype), "float32")


def check_out_dir(out_dir: Path) -> None:
    """``out_dir`` is new or empty; the processes of a multi-process import may have written
    their logs there (``logs/``, see :func:`theseus.distributed.supervise.log_path`)."""
    logs = log_path(out_dir, 0).parent.name
    if out_dir.exists() and (
        not out_dir.is_dir() or any(p.name != logs for p in out_dir.iterdir())
    ):
        raise ValueError(
            f"{out_dir} already exists and is not an empty directory; give a new or empty one "
            "(nothing was written)"
        )


def import_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    policy: ShardingPolicy | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> ImportResult:
    """Import the Hugging Face checkpoint ``hf_dir`` (``config.json`` and safetensors) as the
    run directory ``out_dir``, placing the parameters in ``policy``'s storage layout (default:
    one replica per device, ZeRO on) while reading them."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise ValueError(f"{hf_dir} is not a directory; give a Hugging Face model folder")
    check_out_dir(out_dir)
    if jax.process_count() > 1:  # every process has checked before any writes
        multihost_utils.sync_global_devices("import-hf: output directory checked")
    spec = read_spec(hf_dir)
    hf_spec = spec.family.family.hf
    found = checkpoint_tensors(hf_dir)
    expected = hf_spec.layout_of(spec.model, found)
    infos = match_tensors(expected, found, hf_dir, hf_spec.aliases, hf_spec.unread)
    trainer = import_trainer(spec, policy or ShardingPolicy(), devices)
    params = read_params(trainer, expected, infos)
    dtype = _dtype_name(infos[expected[0].name])
    config = validate(type(trainer.config), {"model": spec.model})
    meta = CheckpointMeta(
        step=0,
        data_position=0,
        config=config.model_dump(mode="json"),
        **trainer.execution_facts(),
        job=spec.job,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    with Checkpointer(out_dir / CHECKPOINTS) as checkpointer:
        checkpointer.save({"params": params}, meta)
        checkpointer.wait()
    copied = [name for name in TOKENIZER_FILES if (hf_dir / name).is_file()]
    if jax.process_index() == 0:
        copy_tokenizer_files(hf_dir, out_dir)
        save_yaml(config, out_dir / "config.yaml")
        record = {
            "job": spec.job,
            **trainer.execution_facts(),  # the policy it was placed under, as a trained run's
            "num_params": trainer.num_params,
            IMPORTED_FROM: {
                "model_type": spec.model_type,
                "dtype": dtype,
                "source": str(hf_dir.absolute()),
                "special_tokens": spec.special_tokens,
            },
        }
        (out_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    result = ImportResult(
        str(out_dir), spec.job, spec.model_type, trainer.num_params, dtype, copied
    )
    logger.info(result.describe())
    return result
