"""Plain-text tables and numbers for what theseus prints: plans, layouts, run summaries."""

from __future__ import annotations

from collections.abc import Sequence


def mesh_text(mesh_shape: dict[str, int]) -> str:
    return " × ".join(f"{axis}={size}" for axis, size in mesh_shape.items())


def number_text(n: float) -> str:
    return f"{n:,.0f}"


def percent(fraction: float) -> str:
    return f"{fraction:.2%}" if fraction >= 0.0001 or fraction == 0 else f"{fraction:.1e}"


def shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def text_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  "
) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    out = [indent + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    for row in rows:
        cells = [str(c).ljust(w) for c, w in zip(row, widths, strict=True)]
        out.append(indent + "  ".join(cells).rstrip())
    return out


def group_path(paths: Sequence[str], width: int | None = None) -> str:
    """``blocks/{attn_q,attn_k}/kernel``: the paths' common leading and trailing segments once,
    the differing middles in braces; with ``width``, middles beyond it are elided (``…``) and the
    count given (``×6``)."""
    if len(paths) == 1:
        return paths[0]
    split = [p.split("/") for p in paths]
    shortest = min(len(s) for s in split)
    lead = 0
    while lead < shortest - 1 and len({s[lead] for s in split}) == 1:
        lead += 1
    trail = 0
    while trail < shortest - 1 - lead and len({s[-1 - trail] for s in split}) == 1:
        trail += 1
    middles = ["/".join(s[lead : len(s) - trail]) for s in split]
    head = "/".join(split[0][:lead])
    tail = "/".join(split[0][len(split[0]) - trail :]) if trail else ""

    def assemble(items: list[str]) -> str:
        middle = "{" + ",".join(items) + "}"
        return (head + "/" if head else "") + middle + ("/" + tail if tail else "")

    text = assemble(middles)
    if width is None or len(text) <= width:
        return text
    shown = list(middles)
    while len(shown) > 1 and len(assemble([*shown, "…"])) + 4 > width:
        shown.pop()
    return f"{assemble([*shown, '…'])} ×{len(paths)}"
