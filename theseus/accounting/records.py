"""Result dataclasses as JSON: one encoder for every record theseus writes or prints.

A mapping becomes an object of its items; a dataclass an object of its fields, where a field's
``metadata["json"]`` renames it (``None`` leaves it out; ``omit_none``: out while its value is
None) and a class's ``json_properties`` adds computed values (property → key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import pydantic
from jax.sharding import PartitionSpec


def json_field(key: str | None, *, omit_none: bool = False, **options: Any) -> Any:
    """A dataclass field written under ``key`` in JSON (``None``: not written; ``omit_none``:
    not written while its value is None, so records without it keep their keys)."""
    return dataclasses.field(metadata={"json": key, "omit_none": omit_none}, **options)


def as_json(value: Any) -> Any:
    """``value`` as plain JSON data (dicts, lists, numbers, strings, None)."""
    if isinstance(value, Mapping):
        return {str(key): as_json(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for field in dataclasses.fields(value):
            key, item = field.metadata.get("json", field.name), getattr(value, field.name)
            if key is not None and not (item is None and field.metadata.get("omit_none")):
                out[key] = as_json(item)
        for attribute, key in getattr(value, "json_properties", {}).items():
            out[key] = as_json(getattr(value, attribute))
        return out
    if isinstance(value, PartitionSpec):
        return [list(entry) if isinstance(entry, tuple) else entry for entry in value]
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, tuple) and hasattr(value, "_asdict"):  # a NamedTuple
        return as_json(value._asdict())
    if isinstance(value, list | tuple):
        return [as_json(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
