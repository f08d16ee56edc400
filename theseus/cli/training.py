"""`theseus train`, `run`, `configure`, `jobs` and `plot`: the commands that configure, run and
show training jobs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from theseus.cli.options import (
    DEFAULT_JOB,
    BaseRun,
    ChainFile,
    Imports,
    JobFlags,
    Overrides,
    PeakTflops,
    ProcessFlags,
    RunDir,
    RunJob,
    Seed,
    Steps,
    echo_on_main,
    fail,
    import_modules,
    job_options,
    join_job,
    layout_options,
    log_lines_to_stderr,
    process_options,
    say_processes,
    sharding_options,
    user_errors,
)


@job_options
def train(
    overrides: Overrides = None,
    job: Annotated[
        str | None,
        typer.Option(
            help="registered job (`theseus jobs` lists them): a training job, or an evaluate "
            "job (FAMILY/evaluate) that scores the run in --out with that run's config [default: "
            f"the --init-from run's job, with --resume the run's, with --hf the model's "
            f"family's training job, else "
            f"{DEFAULT_JOB}]",
            show_default=False,
        ),
    ] = None,
    hf: Annotated[
        Path | None,
        typer.Option(
            "--hf",
            help="train a fresh model of a published model's shape: its Hugging Face "
            "config.json (or the folder holding it) gives the model section (no weights "
            "read); overrides apply on top",
        ),
    ] = None,
    steps: Steps = None,
    seed: Seed = None,
    peak_tflops: PeakTflops = None,
    budget: Annotated[
        str | None,
        typer.Option(
            help="per-device memory, e.g. 80GiB: choose the policy (least communication), "
            "recompute (least) and per-device batch (largest) whose model state and activations "
            "fit, say which, and train with them (instead of --tp/--zero/--fsdp/"
            "--activation-checkpointing)"
        ),
    ] = None,
    out: RunDir = None,
    imports: Imports = None,
    *,
    flags: JobFlags,
) -> None:
    """Train a job, or evaluate the run in --out (--job FAMILY/evaluate).

    The default job trains a GPT on built-in data unless data.path is given.
    """
    join_job(flags.process, out)
    shorthands = {
        "training.steps": steps,
        "training.seed": seed,
        "logging.peak_tflops": peak_tflops,
    }
    extra = [*(overrides or []), *(f"{k}={v}" for k, v in shorthands.items() if v is not None)]
    if flags.run.resume and out is None:
        fail("--resume needs --out: the run directory to continue")
    out = out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    with user_errors():
        import_modules(imports)
        from theseus.execution import quick
        from theseus.hf.config import job_for, read_config, with_model

        spec = None if hf is None else read_config(hf)
        if spec is not None:
            job = job_for(spec, job)
        elif job is None and flags.run.init_from is None and not flags.run.resume:
            job = DEFAULT_JOB  # --init-from and --resume: the job of the run they read
        session = quick(job, out, mode=flags.run)
        if spec is not None:
            session.config = with_model(session.config, spec)
        session.override(*extra)
        session.shard(**flags.sharding)
        if budget is not None:
            fit_budget(session, budget, flags.sharding)
        summary = session()
    echo_on_main(summary.describe())


def fit_budget(session: Any, budget: str, sharding: dict[str, Any]) -> None:
    """Set ``session``'s policy, recompute and per-device batch to the plan that fits
    ``budget`` per device on this process's devices, and say what was chosen."""
    chosen = {"tp", "zero", "fsdp", "activation_checkpointing"} & set(sharding)
    if chosen:
        raise ValueError(
            f"--budget chooses the policy, recompute and per-device batch itself; drop "
            f"{', '.join(sorted('--' + c.replace('_', '-') for c in chosen))} (or drop --budget)."
        )
    import jax

    from theseus.plan import format_bytes, parse_bytes, plan_training_for_budget

    limit = parse_bytes(budget)
    devices = jax.device_count()
    trainer_class = session.job.trainer_class
    result = plan_training_for_budget(
        trainer_class, session.config, devices, limit, devices_per_host=jax.local_device_count()
    )
    acts, total = result.activations, result.total
    if acts is None:
        raise ValueError(
            f"--budget fits the model state and one microbatch's activations, but "
            f"{trainer_class.__name__} gives no activation estimate (its decoder_shape() is "
            "None); choose the policy with `theseus plan --compile` instead, or drop --budget."
        )
    assert result.totals is not None and total is not None  # a chosen plan is valid
    session.override(f"training.per_device_batch_size={acts.examples}")
    session.shard(**result.policy.model_dump())
    echo_on_main(
        f"budget {format_bytes(limit)} per device on {devices} devices: chose {result.name}, "
        f"recompute {acts.remat}, {acts.examples} examples per device ({result.batch}); model "
        f"state {format_bytes(result.totals.total)} + activations {format_bytes(acts.total)} = "
        f"{format_bytes(total)} fits"
    )


@job_options
def run(
    chain_file: ChainFile,
    out: Annotated[Path, typer.Argument(help="output directory of the chain")],
    imports: Imports = None,
    *,
    flags: JobFlags,
) -> None:
    """Run an execution chain saved as YAML; sharding flags merge into its policy."""
    join_job(flags.process, out)
    with user_errors():
        import_modules(imports)
        from theseus.execution import Chain

        chain = Chain.load(chain_file).shard(**flags.sharding)
        results = chain.run(out, mode=flags.run)
    for result in results:
        echo_on_main(result.describe())


@process_options
@layout_options
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="run directory (trained or imported)")],
    overrides: Overrides = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            help="lm-evaluation-harness tasks, comma-separated (e.g. arc_easy,hellaswag): score "
            "them instead of the validation loss (needs the eval extra)"
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(help="with --tasks: at most this many documents a task", min=1)
    ] = None,
    num_fewshot: Annotated[
        int | None, typer.Option(help="with --tasks: few-shot examples in each prompt", min=0)
    ] = None,
    include_path: Annotated[
        Path | None, typer.Option(help="with --tasks: a folder of your own task YAML files")
    ] = None,
    log_samples: Annotated[
        bool, typer.Option("--log-samples", help="with --tasks: also write every request")
    ] = False,
    output_path: Annotated[
        Path | None,
        typer.Option(help="with --tasks: where results go \\[default: RUN_DIR/harness]"),
    ] = None,
    job: RunJob = None,
    base: BaseRun = None,
    imports: Imports = None,
    *,
    sharding: dict[str, Any],
    process: ProcessFlags,
) -> None:
    """Score a run's newest good checkpoint on the run's own data and config, or on tasks.

    The validation loss (overrides on top of the run's config, the model excepted) is written to
    RUN_DIR/eval.json. With --tasks, lm-evaluation-harness scores the run on its tasks instead,
    writing results as it does (RUN_DIR/harness/step<N>/results_<date>.json) and printing its
    table. The run is read under its own layout where it fits the devices at hand, else under
    one that does (named), or under --tp/--zero/--fsdp. It runs in many processes as `train`
    does (`theseus launch`, --coordinator, a detected cluster), on the devices of all of them;
    the first process writes and prints the results.
    """
    log_lines_to_stderr()
    if not run_dir.is_dir():  # before a supervisor makes RUN_DIR/logs
        fail(f"{run_dir} is not a folder: give the directory of a trained or imported run")
    join_job(process, run_dir)
    say_processes()
    harness_options = {
        "--limit": limit,
        "--num-fewshot": num_fewshot,
        "--include-path": include_path,
        "--log-samples": log_samples or None,
        "--output-path": output_path,
    }
    with user_errors():
        import_modules(imports)
        if tasks is not None:
            if overrides:
                raise ValueError(
                    f"config overrides ({' '.join(overrides)}) apply to the validation loss, not "
                    "to --tasks; drop them, or drop --tasks"
                )
            import importlib.util

            if importlib.util.find_spec("lm_eval") is None:
                raise ValueError(
                    "--tasks runs lm-evaluation-harness, which is not installed; install it with "
                    "pip install -c constraints.txt -e '.[eval]'"
                )
            from theseus.inference.tasks import evaluate_tasks

            scores = evaluate_tasks(
                run_dir,
                tasks.split(","),
                limit=limit,
                num_fewshot=num_fewshot,
                include_path=include_path,
                log_samples=log_samples,
                output_path=output_path,
                policy_changes=sharding,
                job=job,
                base=base,
            )
            echo_on_main(scores.describe())
            return
        given = [flag for flag, value in harness_options.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to harness tasks; add --tasks NAMES, or drop them"
            )
        from theseus.inference.runs import evaluate as evaluate_run

        result = evaluate_run(
            run_dir,
            overrides or [],
            policy_changes=sharding,
            job=job,
            base=base,
        )
    echo_on_main(result.describe())


@sharding_options
def configure(
    job: Annotated[str, typer.Argument(help="registered job name, see `theseus jobs`")],
    out_file: Annotated[Path, typer.Argument(help="chain YAML to write")],
    overrides: Overrides = None,
    then: Annotated[
        list[str] | None, typer.Option(help="another job to run after this one (repeatable)")
    ] = None,
    imports: Imports = None,
    *,
    sharding: dict[str, Any],
) -> None:
    """Write a job's full, resolved configuration as a chain YAML to edit and `theseus run`."""
    with user_errors():
        import_modules(imports)
        from theseus.execution import chain

        built = chain(job, *(overrides or [])).shard(**sharding)
        for name in then or ():
            built = built.then(name)
        if imports:
            built = type(built)(built.steps, built.policy, tuple(imports))
        if out_file.exists():
            fail(f"{out_file} exists; choose another file name or remove it first")
        built.save(out_file)
    typer.echo(f"wrote {out_file}: {len(built.steps)} step(s), sharding {built.policy.describe()}")


def jobs(imports: Imports = None) -> None:
    """List the registered jobs with a one-line description."""
    with user_errors():
        import_modules(imports)
        from theseus.jobs import all_jobs

        for job in all_jobs():
            typer.echo(f"{job.name:24s} {job.action:9s} {job.description}")


def plot(
    run_dir: Annotated[Path, typer.Argument(help="a run directory holding metrics.jsonl")],
    out: Annotated[
        Path | None, typer.Option(help="image path \\[default: RUN_DIR/loss.png]")
    ] = None,
) -> None:
    """Plot training and validation loss against step and tokens (loss.png)."""
    with user_errors():
        from theseus.plot import plot_losses

        path = plot_losses(run_dir, out)
    typer.echo(f"wrote {path}")
