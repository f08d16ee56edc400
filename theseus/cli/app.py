"""The ``theseus`` command line: the app, and the one place where its commands are registered.

Command modules define plain functions and never import this module, so there is no import cycle
and ``python -m theseus`` needs no workaround.
"""

from __future__ import annotations

import typer

from theseus.cli import doctor, hf, launch, plan, text, training
from theseus.cli.options import collect_garbage_less_often, show_log_lines

app = typer.Typer(
    help="theseus: train annotated JAX models under DP, TP, ZeRO or FSDP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main(context: typer.Context) -> None:
    """theseus: annotate a model once with logical axis names; train it under any layout."""
    collect_garbage_less_often()
    context.call_on_close(show_log_lines())


# In the order `theseus --help` lists them.
for command in (
    training.train,
    training.run,
    training.evaluate,
    training.configure,
    training.jobs,
    training.plot,
):
    app.command()(command)
app.command(context_settings={"allow_interspersed_args": False})(launch.launch)
app.command(name="plan", context_settings={"allow_extra_args": False})(plan.plan_command)
app.command()(text.tokenize)
app.command()(text.generate)
app.command(name="import-hf", cls=hf.ListsFamilies)(hf.import_hf)
app.command(name="export-hf")(hf.export_hf)
app.command()(doctor.doctor)
