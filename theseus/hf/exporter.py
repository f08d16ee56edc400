"""``theseus export-hf``: a run's newest good parameters as a Hugging Face checkpoint folder.

Writes ``config.json`` (transformers 5.x layout), the weights as safetensors (one
``model.safetensors``, or shards of at most ``max_shard_size`` with
``model.safetensors.index.json``) and the run's tokenizer files. Each tensor (one layer of one
parameter, or GPT-2's ``c_attn`` from its q, k and v columns) is copied to the host in blocks of
rows, each block from the device shards that hold it (no computation across devices: slicing a
sharded array would gather it whole on every device), converted and written block by block, so
host memory beyond the parameters stays within one block (64 MiB of float32).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import ml_dtypes
import numpy as np

from theseus.accounting.memory import parse_bytes
from theseus.hf.config import export_model_type, hf_config, trainer_family
from theseus.hf.importer import IMPORTED_FROM, check_out_dir
from theseus.hf.peft import adapter_config, adapter_tensors, merged_run_params
from theseus.hf.safetensors import write_file
from theseus.inference.logits import load_run
from theseus.model.family import HFTensor
from theseus.sharding.layout import leaf_at
from theseus.tokenization.folder import TOKENIZER_FILES

logger = logging.getLogger(__name__)

ExportDtype = Literal["float32", "bfloat16"]
_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
BLOCK_BYTES = 64 * 2**20  # float32 bytes of one block of rows gathered to the host


@dataclass(frozen=True)
class ExportResult:
    """What ``export_hf`` wrote."""

    out_dir: str
    model_type: str
    dtype: str
    checkpoint_step: int
    files: list[str]
    num_tensors: int

    def describe(self) -> str:
        return (
            f"exported step {self.checkpoint_step} as {self.model_type} ({self.dtype}, "
            f"{self.num_tensors} tensors in {len(self.files)} file(s)) to {self.out_dir}"
        )


def shard_files(tensors: list[HFTensor], dtype: np.dtype, limit: int) -> list[list[HFTensor]]:
    """Tensors grouped in order into files of at most ``limit`` bytes (a larger tensor alone)."""
    files: list[list[HFTensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = int(np.prod(tensor.shape)) * dtype.itemsize
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += nbytes
    return files


@functools.partial(jax.jit, static_argnums=2)
def _take(shard: jax.Array, starts: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """``sizes`` elements of one device's shard from ``starts``: compiled once per shard shape
    and size, whatever the position (a static slice would compile once per layer)."""
    return jax.lax.dynamic_slice(shard, tuple(starts), sizes)


def _shard_part(shard: jax.Array, starts: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray:
    """``sizes`` elements of one device's shard from ``starts``, on the host. A CPU device's
    memory is the host's, so its shard is read in place (no program to compile); an
    accelerator's sends only the part (:func:`_take`)."""
    if all(device.platform == "cpu" for device in shard.devices()):
        return np.asarray(shard)[tuple(slice(a, a + n) for a, n in zip(starts, sizes, strict=True))]
    return np.asarray(jax.device_get(_take(shard, starts, sizes)))


def host_region(array: jax.Array, region: tuple[slice, ...]) -> np.ndarray:
    """``array[region]`` on the host, copied from the device shards that hold it: each distinct
    shard sends only its overlap with the region, and no computation spans devices."""
    out_shape = [s.stop - s.start for s in region]
    out = np.empty(out_shape, array.dtype)
    seen = set()
    for shard in array.addressable_shards:
        bounds = [
            range(*index.indices(size))
            for index, size in zip(shard.index, array.shape, strict=True)
        ]
        key = tuple((b.start, b.stop) for b in bounds)
        if key in seen:
            continue
        seen.add(key)
        overlap = [
            (max(b.start, s.start), min(b.stop, s.stop))
            for b, s in zip(bounds, region, strict=True)
        ]
        if any(lo >= hi for lo, hi in overlap):
            continue
        starts = np.array([lo - b.start for (lo, _), b in zip(overlap, bounds, strict=True)])
        target = tuple(
            slice(lo - s.start, hi - s.start) for (lo, hi), s in zip(overlap, region, strict=True)
        )
        sizes = tuple(hi - lo for lo, hi in overlap)
        out[target] = _shard_part(shard.data, starts, sizes)
    return out


def tensor_blocks(
    params: dict, tensor: HFTensor, dtype: np.dtype, block_bytes: int = BLOCK_BYTES
) -> Iterator[np.ndarray]:
    """One tensor as blocks of rows copied to the host from the device shards and converted
    (float32 blocks of at most ``block_bytes``)."""
    rows = tensor.shape[0]
    row_bytes = 4 * int(np.prod(tensor.shape[1:]))
    # A vector is one block (its parts lie side by side along its only dimension).
    step = rows if len(tensor.shape) == 1 else max(1, block_bytes // row_bytes)
    for start in range(0, rows, step):
        pieces = []
        for part in tensor.parts:
            leaf = leaf_at(params, part.path)  # ([n_layer, [n_expert,]] rows, ...)
            lead = tuple(slice(i, i + 1) for i in part.lead)
            rest = tuple(slice(0, n) for n in leaf.shape[len(lead) + 1 :])
            stop = part.stop - part.start if len(tensor.shape) == 1 else min(rows, start + step)
            region = (*lead, slice(start, stop), *rest)
            block = host_region(leaf, region)  # ([1, [1,]] block, ...) float32
            pieces.append(block[(0,) * len(lead)])
        yield np.concatenate(pieces, axis=tensor.parts[0].axis).astype(dtype)


def tensor_values(
    params: dict, tensors: list[HFTensor], dtype: np.dtype
) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
    """Each tensor's name and its blocks, one tensor after the other."""
    for tensor in tensors:
        yield tensor.name, tensor_blocks(params, tensor, dtype)


def imported_from(run_dir: Path) -> dict[str, Any]:
    """What ``import-hf`` recorded about the model a run came from (model type, dtype, special
    token ids), or nothing for a run trained here."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    found = record.get(IMPORTED_FROM) if isinstance(record, dict) else None
    return found if isinstance(found, dict) else {}


def export_hf(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    adapters: bool = False,
    policy_changes: dict[str, Any] | None = None,
    devices: Sequence[jax.Device] | None = None,
    job: str | None = None,
    base: str | Path | None = None,
) -> ExportResult:
    """Write the newest good checkpoint of ``run_dir`` as a Hugging Face model folder that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads (a LoRA run's adapters merged
    into its weights). ``dtype`` defaults to the dtype the run, or the run it fine-tunes, was
    imported in (float32 for a run trained here). ``adapters``: write a LoRA run's adapters
    alone, in peft's format, for the base model the run was initialised from. The run is read
    under its policy merged with ``policy_changes``, or one that fits ``devices``; ``job`` and
    ``base`` as :func:`theseus.inference.logits.load_run`."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    try:
        limit = parse_bytes(max_shard_size)
    except ValueError as error:
        raise ValueError(f"max shard size: {error}") from None
    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: export writes float32 or bfloat16")
    check_out_dir(out_dir)
    if jax.process_count() > 1:
        raise ValueError("export-hf runs in one process; start it without --coordinator")
    loaded = load_run(
        run_dir,
        layout="storage",
        policy_changes=policy_changes,
        devices=devices,
        job=job,
        base=base,
    )
    base_dir = loaded.base_dir
    spec = loaded.trainer.lora_spec
    if adapters and spec is None:
        raise ValueError(
            f"--adapters: {run_dir} has no LoRA adapters (its finetune.lora_rank is 0); export "
            "its weights without --adapters."
        )
    imported = imported_from(run_dir) or (imported_from(base_dir) if base_dir else {})
    dtype_name = dtype or imported.get("dtype", "float32")
    np_dtype = _DTYPES[dtype_name]
    model = loaded.trainer.config.model.model_dump(mode="json")
    family = trainer_family(loaded.trainer)
    model_type = export_model_type(family, model, imported.get("model_type"))
    tensors = family.family.hf.tensors(model)
    if adapters:
        base_type = imported.get("model_type")
        if base_type not in (None, model_type):
            raise ValueError(
                f"--adapters: {run_dir} fine-tunes a model imported as {base_type}, and theseus "
                f"writes its weights as {model_type} (a gemma3 folder's language model as "
                f"gemma3_text), whose modules peft names otherwise than {base_type}'s; adapters "
                "named for one would not load on the other. Export the merged weights (without "
                f"--adapters), or fine-tune an import of the {model_type} export."
            )
        found = adapter_tensors(family, tensors, loaded.params)
        return _export_adapters(loaded, found, out_dir, np_dtype, base_dir, imported)
    params = merged_run_params(loaded.trainer, loaded.params)
    groups = shard_files(tensors, np_dtype, limit)
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, group in zip(names, groups, strict=True):
        entries = {t.name: (np_dtype, t.shape) for t in group}
        write_file(out_dir / name, entries, tensor_values(params, group, np_dtype))
    if len(groups) > 1:
        weight_map = {
            t.name: name for name, group in zip(names, groups, strict=True) for t in group
        }
        total = sum(int(np.prod(t.shape)) * np_dtype.itemsize for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config(family, model, model_type, dtype_name)
    config |= imported.get("special_tokens") or {}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_tokenizer(run_dir, base_dir, out_dir)
    result = ExportResult(str(out_dir), model_type, dtype_name, loaded.step, names, len(tensors))
    logger.info(result.describe())
    return result


def _copy_tokenizer(run_dir: Path, base_dir: Path | None, out_dir: Path) -> None:
    """The run's tokenizer files, or those of the run it fine-tunes."""
    for name in TOKENIZER_FILES:
        for source in (run_dir, base_dir):
            if source is not None and (source / name).is_file():
                shutil.copyfile(source / name, out_dir / name)
                break


def _export_adapters(loaded, found, out_dir, np_dtype, base_dir, imported) -> ExportResult:
    """peft's ``adapter_config.json`` and ``adapter_model.safetensors`` of a LoRA run (its
    adapters' tensors ``found``)."""
    spec = loaded.trainer.lora_spec
    base = imported.get("source") or (str(base_dir) if base_dir else "")
    config = adapter_config(found, rank=spec.rank, alpha=spec.alpha, base=base)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = {t.name: (np_dtype, t.shape) for t in found}
    name = "adapter_model.safetensors"
    write_file(out_dir / name, entries, tensor_values(loaded.params, found, np_dtype))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    dtype_name = "bfloat16" if np_dtype == _DTYPES["bfloat16"] else "float32"
    result = ExportResult(str(out_dir), "peft-lora", dtype_name, loaded.step, [name], len(found))
    logger.info(result.describe())
    return result
