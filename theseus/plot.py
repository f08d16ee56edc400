"""``theseus plot RUN_DIR``: training and validation loss against step and tokens, the
throughput (tokens/s, and MFU when recorded) and the task scores (``evaluation.tasks``) against
step."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} holds no metrics.jsonl; is it a theseus run directory?")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not valid JSON: {line[:80]!r}") from None
    if not rows:
        raise ValueError(f"{path} is empty: the run recorded no step yet")
    return rows


def plot_losses(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``loss.png`` (train and validation loss by step and by tokens, with each source's
    validation loss for a mixture; tokens/s and MFU by step when the rows have them) and return
    its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    validation = [r for r in rows if "val_loss" in r]
    timed = [r for r in rows if r.get("tokens_per_s") is not None]
    scored = [r for r in rows if r.get("tasks")]
    panels = 2 + bool(timed) + bool(scored)
    figure, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), constrained_layout=True)
    for ax, x_key, label in ((axes[0], "step", "step"), (axes[1], "tokens", "tokens seen")):
        ax.plot([r[x_key] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
        if validation:
            ax.plot(
                [r[x_key] for r in validation],
                [r["val_loss"] for r in validation],
                "o-",
                label="validation",
            )
        for name in source_names(validation):
            by_source = [r for r in validation if name in (r.get("val_loss_by_source") or {})]
            ax.plot(
                [r[x_key] for r in by_source],
                [r["val_loss_by_source"][name] for r in by_source],
                ".--",
                lw=1,
                label=f"validation: {name}",
            )
        ax.set_xlabel(label)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
    if timed:
        plot_throughput(axes[2], timed)
    if scored:
        plot_scores(axes[-1], scored)
    figure.suptitle(f"theseus run {Path(run_dir).resolve().name}")
    out = Path(out) if out is not None else Path(run_dir) / "loss.png"
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def source_names(rows: list[dict]) -> list[str]:
    """The sources of a mixture's ``val_loss_by_source``, in the order they first appear."""
    names: dict[str, None] = {}
    for row in rows:
        names |= dict.fromkeys(row.get("val_loss_by_source") or {})
    return list(names)


def plot_throughput(ax, rows: list[dict]) -> None:
    """Tokens/s by step; MFU on a second axis when the rows have it."""
    steps = [r["step"] for r in rows]
    lines = ax.plot(steps, [r["tokens_per_s"] for r in rows], lw=1, color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s", color="tab:green")
    ax.grid(alpha=0.3)
    with_mfu = [r for r in rows if r.get("mfu") is not None]
    if with_mfu:
        mfu_axis = ax.twinx()
        mfu = [100 * r["mfu"] for r in with_mfu]
        lines += mfu_axis.plot([r["step"] for r in with_mfu], mfu, "--", lw=1, color="tab:red")
        mfu_axis.set_ylabel("MFU (%)", color="tab:red")
    ax.legend(lines, ["tokens/s", "MFU"][: len(lines)])


def plot_scores(ax, rows: list[dict]) -> None:
    """Each task score (``evaluation.tasks``) by step, on one symmetric-log axis: accuracies
    near 1 and perplexities in the thousands stay readable together."""
    names: dict[str, None] = {}
    for row in rows:
        names |= dict.fromkeys(row["tasks"])
    for name in names:
        with_score = [r for r in rows if name in r["tasks"]]
        ax.plot([r["step"] for r in with_score], [r["tasks"][name] for r in with_score], "o-")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("task score")
    ax.grid(alpha=0.3)
    ax.legend(list(names), fontsize="small")
