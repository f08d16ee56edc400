"""``theseus import-hf`` and ``theseus export-hf``: Hugging Face checkpoints in and out.
Registered by :mod:`theseus.cli.app`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from theseus.cli.options import (
    BaseRun,
    CPUDevices,
    Imports,
    ProcessFlags,
    RunJob,
    import_modules,
    join_job,
    layout_options,
    log_lines_to_stderr,
    process_options,
    use_cpu_devices,
    user_errors,
)


class ListsFamilies(TyperCommand):
    """A command whose ``--help`` ends with the registered families and the Hugging Face model
    types each reads (``config.json``'s ``model_type``), asked of the registry only when that
    help is shown: the registry loads JAX, which ``theseus --help`` never does."""

    # (ctx, formatter): typer's own copy of click's types, which it does not export
    def format_help(self, *args: Any, **kwargs: Any) -> None:
        from theseus.jobs import families

        listed = "; ".join(
            f"{name}: {', '.join(registered.family.hf.model_types)}"
            for name, registered in families().items()
        )
        shown = copy.copy(self)
        shown.help = (
            f"{self.help}\n\nThe registered families and the Hugging Face model types "
            f"(config.json's model_type) each reads: {listed}."
        )
        TyperCommand.format_help(shown, *args, **kwargs)


@process_options
@layout_options
def import_hf(
    hf_dir: Annotated[
        Path, typer.Argument(help="Hugging Face model folder (config.json, *.safetensors)")
    ],
    out_dir: Annotated[Path, typer.Argument(help="new run directory to create")],
    sharding: dict | None = None,
    *,
    process: ProcessFlags,
) -> None:
    """Import a Hugging Face checkpoint of a registered model family as a run directory.

    The weights are streamed into the storage layout of the given policy and the tokenizer files
    copied. In a multi-process job (`theseus launch`, --coordinator) each process reads only its
    own devices' slices.
    """
    log_lines_to_stderr()
    join_job(process, out_dir)
    with user_errors():
        from theseus.hf.importer import import_hf as run_import
        from theseus.sharding.axis import ShardingPolicy

        policy = ShardingPolicy(**(sharding or {}))
        run_import(hf_dir, out_dir, policy=policy)


@layout_options
def export_hf(
    run_dir: Annotated[Path, typer.Argument(help="run directory (trained or imported)")],
    out_dir: Annotated[Path, typer.Argument(help="new Hugging Face model folder to create")],
    dtype: Annotated[
        str | None,
        typer.Option(help="float32 or bfloat16 \\[default: the imported dtype, else float32]"),
    ] = None,
    max_shard_size: Annotated[
        str, typer.Option(help="largest safetensors file, e.g. 5GB or 500MB")
    ] = "5GB",
    adapters: Annotated[
        bool, typer.Option(help="a LoRA run's adapters alone, in peft's format")
    ] = False,
    job: RunJob = None,
    base: BaseRun = None,
    cpu_devices: CPUDevices = None,
    imports: Imports = None,
    sharding: dict | None = None,
) -> None:
    """Export a run's newest good checkpoint as a Hugging Face model folder.

    The folder holds config.json, safetensors and the tokenizer files, loadable by transformers'
    AutoModelForCausalLM.from_pretrained (LoRA adapters merged into the weights); with --adapters,
    a LoRA run's adapters alone as peft's adapter_config.json + adapter_model.safetensors. The
    run is read under its own layout where it fits the devices at hand, else under one that
    does (named), or under --tp/--zero/--fsdp.
    """
    log_lines_to_stderr()
    use_cpu_devices(cpu_devices)
    with user_errors():
        import_modules(imports)
        from theseus.hf.exporter import export_hf as run_export

        run_export(
            run_dir,
            out_dir,
            dtype=dtype,
            max_shard_size=max_shard_size,
            adapters=adapters,
            policy_changes=sharding,
            job=job,
            base=base,
        )
