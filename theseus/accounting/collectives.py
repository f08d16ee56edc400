"""Collectives of one compiled step, per device: how many and how many bytes, loops unrolled.

Reads the text of a compiled XLA module (``compiled.as_text()``), so it counts what will run, not
what the program asked for. For each of ``all-gather``, ``reduce-scatter``, ``all-reduce``,
``all-to-all`` and ``collective-permute`` it gives ``count`` and ``bytes`` per device per step:
an op inside a ``while`` loop counts once per iteration (XLA's ``known_trip_count``), so the
microbatch scan and the layer scan are multiplied out. ``bytes`` is the size of the whole buffer
the collective works on, as each device sees it: the result of an all-gather, the operand of a
reduce-scatter, the operand (= result) of the others. A ring implementation sends about
(N-1)/N of it per device.

Asynchronous pairs (``all-gather-start`` / ``all-gather-done``) count once, at ``-done``, whose
result is the collective's output; ops wrapped by ``async-start`` count inside the wrapped
computation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache

OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_CALLEE = re.compile(
    r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([^\s,]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PARENS = re.compile(r"[()]")
_OPERAND = re.compile(r"%([^\s,()]+)")


@dataclass(frozen=True)
class CollectiveTotal:
    """One kind of collective over a step: how many run and how many bytes they handle."""

    count: int = 0
    bytes: int = 0

    def __add__(self, other: CollectiveTotal) -> CollectiveTotal:
        return CollectiveTotal(self.count + other.count, self.bytes + other.bytes)

    def __mul__(self, times: int) -> CollectiveTotal:
        return CollectiveTotal(self.count * times, self.bytes * times)


@dataclass(frozen=True)
class Collectives(Mapping[str, CollectiveTotal]):
    """Per-device collectives of one step: a mapping from every kind of :data:`OPS` (in that
    order) to its total."""

    totals: dict[str, CollectiveTotal] = field(default_factory=dict)

    def __getitem__(self, op: str) -> CollectiveTotal:
        if op not in OPS:
            raise KeyError(f"unknown collective {op!r}; expected one of {OPS}")
        return self.totals.get(op, CollectiveTotal())

    def __iter__(self) -> Iterator[str]:
        return iter(OPS)

    def __len__(self) -> int:
        return len(OPS)

    @property
    def bytes(self) -> int:
        """All collective bytes of the step."""
        return sum(self[op].bytes for op in OPS)


def hlo_type_bytes(type_text: str) -> int:
    """Bytes of an HLO type: one array (``f32[4,8]{1,0}``) or a tuple of them (summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        itemsize = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if itemsize is None:
            raise ValueError(f"unknown HLO element type {dtype!r} in {type_text[:120]!r}")
        total += itemsize * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """``(type, remainder)`` of an instruction's right-hand side: the type is one token or a
    parenthesised tuple."""
    if not rest.startswith("("):
        type_text, _, remainder = rest.partition(" ")
        return type_text, remainder
    end = _closing(rest, 0)
    if end is None:
        raise ValueError(f"unbalanced tuple type in HLO instruction: {rest[:120]!r}")
    return rest[: end + 1], rest[end + 1 :].lstrip()


def _closing(text: str, depth: int) -> int | None:
    """The index in ``text`` where the parentheses open before it (``depth``) and in it close,
    or None if they never do. (Jumps from parenthesis to parenthesis: HLO lines are long.)"""
    for paren in _PARENS.finditer(text):
        depth += 1 if paren.group() == "(" else -1
        if depth == 0:
            return paren.start()
    return None


@dataclass(frozen=True)
class _Instruction:
    name: str
    type_text: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    #: Computations it calls, each with how many times per call of it (:func:`_callees`).
    callees: tuple[tuple[str, int | None], ...]


def _parse_instruction(line: str) -> _Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    name, rest = match.groups()
    type_text, remainder = _split_type(rest)
    opcode, paren, args = remainder.partition("(")
    if not paren:
        return None
    end = _closing(args, 1)
    if end is None:
        end = len(args)
    operands = tuple(_OPERAND.findall(args, 0, end))
    opcode, attributes = opcode.strip(), args[end + 1 :]
    callees = _callees(name, opcode, attributes)
    return _Instruction(name, type_text, opcode, operands, attributes, callees)


@lru_cache(maxsize=1)  # one text is read for its collectives, then its FLOPs
def _computations(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """Every computation's instructions by name, and the name of the entry computation (not to
    be changed: the result is shared)."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t")):
            header = _HEADER.match(line)
            current = header.group(1) if header else None
            if current is not None:
                computations[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text()")
    return computations, entry


def _kind(opcode: str) -> str | None:
    """The collective an opcode performs (``-done`` carries the result), else None."""
    if opcode in OPS:
        return opcode
    if opcode.endswith("-done") and opcode[: -len("-done")] in OPS:
        return opcode[: -len("-done")]
    return None


def _callees(name: str, opcode: str, attributes: str) -> tuple[tuple[str, int | None], ...]:
    """Computations an instruction calls, each with how many times per call of it (None: a
    while loop whose trip count is known only at run time, such as the blockwise attention's
    loops over the blocks a mask leaves visible)."""
    if opcode.endswith("-done"):
        return ()  # an async pair's wrapped computation is reached from its -start
    if not ("to_apply=" in attributes or "calls=" in attributes or "body=" in attributes
            or "computation" in attributes):  # fmt: skip
        return ()  # most lines call nothing: no regex over them
    names = _CALLEE.findall(attributes)
    for branches in _BRANCHES.findall(attributes):
        names += re.findall(r"%?([^\s,]+)", branches)
    if opcode != "while":
        return tuple((callee, 1) for callee in names)
    trip = _TRIP_COUNT.search(attributes)
    found = re.search(r"\bbody=%?([^\s,]+)", attributes)
    assert found is not None, f"while loop {name} names no body"  # XLA always does
    body = found.group(1)
    return ((body, None if trip is None else int(trip.group(1))),)  # the condition: no collectives


def count_collectives(hlo_text: str) -> Collectives:
    """The collectives one execution of the compiled module runs, per device, loops unrolled."""
    computations, entry = _computations(hlo_text)

    @cache
    def totals(name: str) -> tuple[tuple[str, CollectiveTotal], ...]:
        instructions = computations.get(name, [])
        types = {i.name: i.type_text for i in instructions}
        found: dict[str, CollectiveTotal] = {}
        for instruction in instructions:
            kind = _kind(instruction.opcode)
            if kind is not None:
                type_text = instruction.type_text
                if kind == "reduce-scatter":
                    type_text = " ".join(types[o] for o in instruction.operands)
                one = CollectiveTotal(1, hlo_type_bytes(type_text))
                found[kind] = found.get(kind, CollectiveTotal()) + one
            for callee, times in instruction.callees:
                inner = totals(callee)
                if not inner:
                    continue
                if times is None:
                    raise ValueError(
                        f"while loop {instruction.name} runs collectives and has no known trip "
                        "count in the compiled HLO, so they cannot be counted per step; loops "
                        "from lax.scan and fori_loop with static bounds have one."
                    )
                for callee_kind, total in inner:
                    found[callee_kind] = found.get(callee_kind, CollectiveTotal()) + total * times
        return tuple(found.items())

    return Collectives(dict(totals(entry)))


def _dims(type_text: str) -> list[int]:
    """The dimensions of one HLO array type (``f32[4,8]{1,0}`` -> [4, 8])."""
    match = _ARRAY.search(type_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def _dot_flops(instruction: _Instruction, types: dict[str, str]) -> int:
    """2 x output elements x contracted elements of one ``dot``."""
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instruction.attributes)
    lhs = _dims(types.get(instruction.operands[0], ""))
    contracted = [lhs[int(d)] for d in contracting.group(1).split(",") if d] if contracting else []
    return 2 * math.prod(_dims(instruction.type_text)) * math.prod(contracted)


def count_dot_flops(hlo_text: str) -> int:
    """FLOPs of the matmuls (``dot``) one execution of the compiled module runs, per device,
    loops unrolled: recomputation included (XLA's ``cost_analysis()`` counts a loop body once,
    whatever its trip count). A loop whose trip count is known only at run time (the blockwise
    attention's, over the blocks its mask leaves visible) is counted once."""
    computations, entry = _computations(hlo_text)

    @cache
    def flops(name: str) -> int:
        instructions = computations.get(name, [])
        types = {i.name: i.type_text for i in instructions}
        total = 0
        for instruction in instructions:
            if instruction.opcode == "dot":
                total += _dot_flops(instruction, types)
            total += sum(
                flops(callee) * (1 if times is None else times)
                for callee, times in instruction.callees
            )
        return total

    return flops(entry)


def loop_bodies_with(hlo_text: str, op: str) -> list[tuple[str, int | None]]:
    """``(body name, trip count)`` of every ``while`` loop whose body itself (not a nested loop)
    runs collective ``op``, for checking where communication sits (None: a trip count known
    only at run time)."""
    computations, _ = _computations(hlo_text)
    bodies = []
    for instructions in computations.values():
        for instruction in instructions:
            if instruction.opcode != "while":
                continue
            for body, trip in instruction.callees:
                if any(_kind(i.opcode) == op for i in computations.get(body, [])):
                    bodies.append((body, trip))
    return bodies


def loop_collective_types(hlo_text: str, op: str) -> list[tuple[int | None, str]]:
    """``(trip count, result type)`` of every collective ``op`` in the body of a ``while`` loop
    (not a nested loop), for checking what the layer loop moves (e.g. ``u16[64,64]{1,0}``;
    None: a trip count known only at run time)."""
    computations, _ = _computations(hlo_text)
    found = []
    for body, trip in loop_bodies_with(hlo_text, op):
        found += [(trip, i.type_text) for i in computations[body] if _kind(i.opcode) == op]
    return found
