"""Sliding-window attention per layer, shared by the families that have it: which layers slide
(Hugging Face's ``layer_types`` names), each layer's window for :func:`theseus.scan_layers`, and
the Hugging Face keys that say so, read and written as transformers reads them."""

from __future__ import annotations

from typing import Any, Literal

LayerType = Literal["full_attention", "sliding_attention"]
KINDS: tuple[LayerType, ...] = ("full_attention", "sliding_attention")


def check_layer_types(
    owner: str, layer_types: tuple[str, ...] | None, num_layers: int, window: int | None
) -> None:
    """Refuse ``layer_types`` that do not name one kind per layer, or that name sliding layers
    without a window."""
    if layer_types is not None and len(layer_types) != num_layers:
        raise ValueError(
            f"{owner}.layer_types has {len(layer_types)} entries for num_layers={num_layers}; "
            "give one per layer."
        )
    if layer_types is not None and window is None:
        raise ValueError(
            f"{owner}.layer_types is set but sliding_window is not: set the window of the "
            "sliding layers, or drop layer_types."
        )


def layer_windows(
    layer_types: tuple[str, ...] | None, num_layers: int, window: int | None
) -> tuple[int | None, ...]:
    """Each layer's attention window (None: the whole context); no ``layer_types``: every layer
    slides when there is a window."""
    types = layer_types or ("sliding_attention",) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def windows_from_hf(hf: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers reads them: Mistral's window on
    every layer; Qwen2's and Qwen3's when ``use_sliding_window``, on the layers ``layer_types``
    names or else on those from ``max_window_layers`` on; none for Llama."""
    window = hf.get("sliding_window")
    if model_type == "mistral" or window is None:
        return {"sliding_window": window if model_type == "mistral" else None}
    if model_type not in ("qwen2", "qwen3") or not hf.get("use_sliding_window"):
        return {"sliding_window": None}
    first, num_layers = hf.get("max_window_layers", 28), hf["num_hidden_layers"]
    types = hf.get("layer_types") or [KINDS[i >= first] for i in range(num_layers)]
    unknown = sorted(set(types) - set(KINDS))
    if unknown:
        raise ValueError(
            f"{where}: layer_types holds {unknown}; theseus has full_attention and "
            "sliding_attention layers"
        )
    if "sliding_attention" not in types:
        return {"sliding_window": None}
    every = all(t == "sliding_attention" for t in types)
    return {"sliding_window": window, "layer_types": None if every else list(types)}


def windows_to_hf(model: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's and Qwen3's keys for the model's windows (as :func:`windows_from_hf` reads)."""
    window, num_layers = model.get("sliding_window"), model["num_layers"]
    if window is None:
        return {"use_sliding_window": False, "sliding_window": None}
    types = model.get("layer_types") or ["sliding_attention"] * num_layers
    full = [t == "full_attention" for t in types] + [False]
    return {
        "use_sliding_window": True,
        "sliding_window": window,
        "max_window_layers": full.index(False),  # the leading full layers (transformers 4.x)
        "layer_types": list(types),
    }
