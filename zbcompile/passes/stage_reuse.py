"""Pass: which stages compile to the same programs, so that their joint graphs, I/W split and
costs are computed once.

A deep model cut into many stages repeats itself: the middle stages of an 80-layer decoder cut
in eight each hold ten identical blocks. `stage_fingerprint` is a stage's graph fingerprint
(`graph_fingerprint`: the graph with node, parameter and buffer names left out) plus what the
joint pass reads besides the graph: which inputs carry a gradient, which outputs get one from
the next stage, whether the stage computes the loss, and its buffer updates. Stages with equal
stage fingerprints export identical joint graphs (up to names), split identically and cost the
same (FLOPs, bytes, M_B, M_W, action peaks), which `tests/passes/test_stage_reuse.py` checks
against compiling every stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable

from zbcompile.passes.graph_fingerprint import graph_fingerprint
from zbcompile.passes.joint import StageJoint
from zbcompile.passes.partition import Stage, StagePartition
from zbcompile.passes.program import Program, Signature
from zbcompile.passes.split_backward import StageIWPrograms
from zbcompile.value_names import BUFFER, GRAD, INPUT, OUTPUT, PARAM, PARAM_GRAD, TANGENT, UPDATE


def stage_fingerprint(
    stage: Stage, partition: StagePartition, grads_from_next: set[str], last: bool
) -> tuple[Hashable, ...]:
    """The stage's graph fingerprint with what its joint export depends on besides the graph:
    which inputs may carry a gradient (by position), which outputs get one from the next stage,
    whether it computes the loss, and how many buffers it updates."""
    differentiable = tuple(
        bool(partition.values[n].differentiable) if n in partition.values else None for n in stage.graph_inputs
    )
    receives_grads = tuple(o in grads_from_next for o in stage.graph_outputs)
    return (graph_fingerprint(stage.module), differentiable, receives_grads, last, len(stage.buffer_updates))


# --- a stage's programs from an identical stage's -------------------------------------------------


def stage_name_map(first: Stage, other: Stage) -> dict[str, str]:
    """What `first`'s names stand for in `other`, two stages with equal fingerprints: boundary
    values and targets by position among the graph's inputs and outputs, parameter and buffer
    FQNs by position among its `get_attr`s."""
    mapping = dict(zip(first.graph_inputs, other.graph_inputs, strict=True))
    mapping.update(zip(first.graph_outputs, other.graph_outputs, strict=True))
    for mine, theirs in zip(first.module.graph.nodes, other.module.graph.nodes, strict=True):
        if mine.op == "get_attr" and mine.target in first.state_fqns:
            mapping[first.state_fqns[mine.target]] = other.state_fqns[theirs.target]
    return mapping


_RENAMED_PREFIXES = (PARAM_GRAD, PARAM, BUFFER, UPDATE, INPUT, OUTPUT, TANGENT, GRAD)


def renamed(name: str, mapping: dict[str, str]) -> str:
    """`name` (an environment name such as `grad:param:<fqn>`, or a bare value or FQN) with what
    it names mapped; `saved:`/`stash:` names and graph-internal names stay (identical stages'
    joint graphs name their nodes alike)."""
    for prefix in _RENAMED_PREFIXES:
        if name.startswith(prefix):
            return prefix + mapping[name[len(prefix):]]
    return mapping.get(name, name)


def renamed_program(program: Program, mapping: dict[str, str]) -> Program:
    """The same graph under `other`'s names (the graph object is shared: programs are pure)."""
    signature = Signature(
        tuple(renamed(n, mapping) for n in program.signature.inputs),
        tuple(renamed(n, mapping) for n in program.signature.outputs),
    )
    return Program(program.graph, signature)


def _renamed_fields(
    value: Any, index: int, mapping: dict[str, str], programs: tuple[str, ...], names: tuple[str, ...], **other: Any
) -> Any:
    """`value` (a joint or a split) as stage `index`'s: its `programs` and its tuples of `names`
    renamed by `mapping`, and the `other` fields given."""
    return dataclasses.replace(
        value,
        stage=index,
        **{f: renamed_program(getattr(value, f), mapping) for f in programs},
        **{f: tuple(renamed(v, mapping) for v in getattr(value, f)) for f in names},
        **other,
    )


def renamed_joint(joint: StageJoint, index: int, mapping: dict[str, str]) -> StageJoint:
    """`joint` as stage `index`'s, whose names `mapping` gives (`stage_name_map`)."""
    return _renamed_fields(
        joint, index, mapping, ("forward", "backward"), ("tangents", "input_grads", "param_grads", "output_grads"),
        storage={renamed(k, mapping): v for k, v in joint.storage.items()},
        alternatives=tuple(renamed_joint(a, index, mapping) for a in joint.alternatives),
    )


def renamed_split(split: StageIWPrograms, index: int, mapping: dict[str, str]) -> StageIWPrograms:
    """`split` as stage `index`'s (see `renamed_joint`)."""
    names = ("stash", "weight_reads", "input_param_grads", "freed_after_input")
    return _renamed_fields(split, index, mapping, ("input_backward", "weight_backward"), names)
