"""``theseus plot RUN_DIR``: training and validation loss against step and tokens."""

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
    """Write ``loss.png`` (train and validation loss, by step and by tokens) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    validation = [r for r in rows if "val_loss" in r]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, x_key, label in ((axes[0], "step", "step"), (axes[1], "tokens", "tokens seen")):
        ax.plot([r[x_key] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
        if validation:
            ax.plot(
                [r[x_key] for r in validation],
                [r["val_loss"] for r in validation],
                "o-",
                label="validation",
            )
        ax.set_xlabel(label)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
    figure.suptitle(f"theseus run {Path(run_dir).resolve().name}")
    out = Path(out) if out is not None else Path(run_dir) / "loss.png"
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
