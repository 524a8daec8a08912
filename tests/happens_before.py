"""Checks on the dependency graph that `RecordingStreams` records: which op must happen before which."""

from __future__ import annotations

from superinfer.engine.worker.streams import Block, Op


def ancestors(ops: list[Op]) -> list[int]:
    """For each op, a bit set of the ops with a path to it (ops only wait for earlier ops)."""
    reach: list[int] = []
    for op in ops:
        mask = 0
        for d in op.deps:
            mask |= reach[d] | (1 << d)
        reach.append(mask)
    return reach


def unordered_conflicts(ops: list[Op]) -> list[tuple[Block, str, str]]:
    """Pairs of ops that touch one block, one of them writing, with no path between them.

    Per block it suffices to order each write after the previous write and the reads since, and
    each read after the previous write: the other pairs follow by transitivity."""
    reach = ancestors(ops)
    last_write: dict[Block, int] = {}
    reads_since: dict[Block, list[int]] = {}
    bad: list[tuple[Block, str, str]] = []

    def check(block: Block, before: int, op: Op) -> None:
        if before != op.id and not reach[op.id] >> before & 1:
            bad.append((block, ops[before].label, op.label))

    for op in ops:
        for block in op.access.reads:
            if block in last_write:
                check(block, last_write[block], op)
            reads_since.setdefault(block, []).append(op.id)
        for block in op.access.writes:
            if block in last_write:
                check(block, last_write[block], op)
            for r in reads_since.pop(block, []):
                check(block, r, op)
            last_write[block] = op.id
    return bad


def copy_ins_after_compute(ops: list[Op]) -> list[tuple[Op, Op, bool]]:
    """(copy-in of step t+1, compute of step t, whether a path leads from that compute to it)."""
    reach = ancestors(ops)
    compute = {_step(op): op for op in ops if op.label.startswith("compute ")}
    out = []
    for op in ops:
        before = compute.get(_step(op) - 1) if op.label.startswith("copy_in ") else None
        if before is not None:
            out.append((op, before, bool(reach[op.id] >> before.id & 1)))
    return out


def copy_ins_waiting_without_cause(ops: list[Op]) -> list[str]:
    """Copy-ins of step t+1 with a path from step t's compute although they write no block that
    step's compute touches: the pipelining DuplexKV promises did not happen."""
    return [
        copy_in.label
        for copy_in, compute, waits in copy_ins_after_compute(ops)
        if waits and not copy_in.access.writes & (compute.access.reads | compute.access.writes)
    ]


def _step(op: Op) -> int:
    return int(op.label.split()[1])
