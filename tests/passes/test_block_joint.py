"""A stage's joint graph stitched from its blocks' joints (`passes/block_joint.py`, on by default
in `compile_pipeline`), each distinct block exported once, is the graph the stage's own export
gives, node for node (ops, arguments, shapes, names, descriptors); the F, B, I and W programs,
the costs and a pipelined step's gradients are those of compiling with `reuse_blocks=False`;
a stage whose blocks read one parameter, or differ, is exported whole."""

from __future__ import annotations

import unittest
from unittest import mock

import pytest
import torch
import transformers
from torch import nn

from helpers import models, real_models
from zbcompile import _torch_internals as ti
from zbcompile.compiler import compile_costs, compile_pipeline
from zbcompile.passes import block_joint
from zbcompile.passes.graph_fingerprint import graph_fingerprint
from zbcompile.passes.joint import _example_inputs, _prepare_outputs, _separate_forward
from zbcompile.passes.partition import partition_stages
from zbcompile.passes.trace import trace_model
from zbcompile.runtime.parallel import batch
from zbcompile.runtime.step.local import LocalRunner
from zbcompile.schedules import make_schedule
from zbcompile.value_names import buffer_name, param_name

PROGRAMS = ("forward", "backward", "input_backward", "weight_backward")


def deeper_llama() -> real_models.RealCase:
    """real_models' Llama with six layers, so that each of two stages holds two identical ones (or more)."""
    case = real_models.build("llama")
    torch.manual_seed(0)
    config = case.model.config
    config.num_hidden_layers = 6
    case.model = transformers.LlamaForCausalLM(config)
    return case


def cases() -> dict[str, tuple[object, int]]:
    """name -> (case, stages): the zoo's Llama and real_models' Llama in one stage (two blocks), a
    six-layer Llama in two (a stage whose outputs take gradients from the next)."""
    return {
        "zoo llama": (models.build("llama"), 1),
        "llama": (real_models.build("llama"), 1),
        "llama 6x2": (deeper_llama(), 2),
    }


def graph_form(graph_module: torch.fx.GraphModule) -> list:
    """Every node's name, op, target, argument names and descriptor, in order."""
    form = []
    for node in graph_module.graph.nodes:
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)
        form.append((node.name, node.op, str(node.target), str(args), str(node.meta.get("desc"))))
    return form


def stage_joints(case, stages: int, shared: bool = True):
    """Per stage, last first: (the stage, the forms (`graph_fingerprint`, `graph_form`) of its own
    joint export and of the stitched joint (None where not stitched), exports the stitch made,
    the stage's segments). `shared`: the stages' stitches share one record of exported segments
    (as `export_stage_joints` does), so a block alike in two stages is exported once."""
    traced = trace_model(case.model, case.loss_fn, case.args, case.kwargs, case.target)
    partition = partition_stages(traced, stages)
    results, grads_from_next, exported = [], set(), {}
    for stage in reversed(partition.stages):
        loss = "loss" if stage.index == stages - 1 else None
        whole = ti.export_joint(
            _prepare_outputs(stage, grads_from_next, loss), _example_inputs(stage, partition, traced.fake_mode)
        )
        record = exported if shared else None
        with mock.patch.object(ti, "export_joint", wraps=ti.export_joint) as exports:
            stitched = block_joint.stitched_joint(stage, partition, grads_from_next, loss, traced.fake_mode, record)
        forms = [None if g is None else (graph_fingerprint(g), graph_form(g)) for g in (whole, stitched)]
        results.append((stage, *forms, exports.call_count, len(block_joint.segments(stage))))
        joint = _separate_forward(whole, stage, loss)
        grads_from_next = set(joint.input_grads) | {v for v in stage.relays if v in grads_from_next}
    return results


# one xdist group: `pytest -n` runs setUpClass's compiles in one worker
@pytest.mark.xdist_group("stitched-joint")
class StitchedJointTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cases = cases()
        cls.joints = {name: stage_joints(case, stages) for name, (case, stages) in cls.cases.items()}

    def test_stitched_joint_is_the_stage_export_node_for_node(self):
        for name in self.cases:
            for stage, whole, stitched, exports, segments in self.joints[name]:
                where = f"{name}, stage {stage.index}"
                self.assertIsNotNone(stitched, f"{where}: not stitched")
                self.assertLess(exports, segments, f"{where}: no block reused")
                self.assertEqual(stitched[0], whole[0], where)
                self.assertEqual(stitched[1], whole[1], where)

    def test_a_block_alike_in_two_stages_is_exported_once(self):
        case, stages = self.cases["llama 6x2"]
        alone = stage_joints(case, stages, shared=False)
        shared = self.joints["llama 6x2"]
        for (stage, whole, stitched, _, _), (_, _, stitched_alone, _, _) in zip(shared, alone, strict=True):
            self.assertEqual(stitched, whole, f"stage {stage.index}")
            self.assertEqual(stitched_alone, whole, f"stage {stage.index}")
        # the first stage's middle layers are the second stage's: exported there already
        self.assertLess(sum(r[3] for r in shared), sum(r[3] for r in alone))

    def test_programs_costs_and_gradients_equal_exporting_stages_whole(self):
        for name, (case, stages) in self.cases.items():
            micro_inputs, micro_targets, _ = batch.split(case.args, case.kwargs, case.target, 2)
            (args, kwargs), target = micro_inputs[0], micro_targets[0]
            compile_args = (case.model, case.loss_fn, args, kwargs, target, stages)
            by_blocks = compile_pipeline(*compile_args)
            whole = compile_pipeline(*compile_args, reuse_blocks=False)
            for mine, theirs in zip(by_blocks.programs, whole.programs, strict=True):
                where = f"{name}, stage {mine.index}"
                for program in PROGRAMS:
                    a = getattr(mine.joint if program == "backward" else mine, program)
                    b = getattr(theirs.joint if program == "backward" else theirs, program)
                    self.assertEqual(a.signature, b.signature, f"{where} {program}")
                    self.assertEqual(a.graph.code, b.graph.code, f"{where} {program}")
                    self.assertEqual(graph_fingerprint(a.graph), graph_fingerprint(b.graph), f"{where} {program}")
                self.assertEqual(mine.cost, theirs.cost, where)
            costed = compile_costs(*compile_args)
            self.assertEqual(costed.costs, tuple(p.cost for p in whole.programs), name)
            self.assert_same_gradients(case, by_blocks, whole, stages, name, micro_inputs, micro_targets)

    def assert_same_gradients(
        self, case, by_blocks, whole, stages: int, name: str, micro_inputs, micro_targets
    ) -> None:
        state = {param_name(n): p for n, p in case.model.named_parameters()}
        state.update((buffer_name(n), b) for n, b in case.model.named_buffers())
        grads = []
        for compiled in (by_blocks, whole):
            runner = LocalRunner(compiled, make_schedule("zb-h1" if stages > 1 else "1f1b", stages, 2), state)
            runner.step(*batch.feeds(compiled, micro_inputs, micro_targets))
            grads.append(runner.reduce_grads())
        self.assertEqual(set(grads[0]), set(grads[1]), name)
        self.assertTrue(any(g.abs().sum() > 0 for g in grads[0].values()), f"{name}: every gradient is zero")
        for parameter, grad in grads[0].items():
            self.assertTrue(torch.equal(grad, grads[1][parameter]), f"{name}: {parameter}")


class TiedBlocks(nn.Module):
    """Blocks reading one weight (`tied`), or of different widths."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        widths = (8, 8, 8, 8) if tied else (8, 6, 4)
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        if tied:
            self.blocks[2].weight = self.blocks[1].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.sum(-1)


def tiny_case(tied: bool) -> real_models.RealCase:
    torch.manual_seed(0)
    return real_models.RealCase(
        "tied", TiedBlocks(tied), (torch.randn(4, 8),), {}, torch.randn(4), nn.functional.mse_loss
    )


class FallbackTest(unittest.TestCase):
    def test_blocks_reading_one_weight_or_differing_export_the_stage_whole(self):
        for tied in (True, False):
            case = tiny_case(tied)
            ((stage, whole, stitched, exports, segments),) = stage_joints(case, 1)
            self.assertGreaterEqual(segments, 2)
            self.assertIsNone(stitched, f"tied={tied}")
            self.assertEqual(exports, 0, f"tied={tied}")
            by_blocks = compile_pipeline(case.model, case.loss_fn, case.args, case.kwargs, case.target, 1)
            whole = compile_pipeline(
                case.model, case.loss_fn, case.args, case.kwargs, case.target, 1, reuse_blocks=False
            )
            self.assertEqual(by_blocks.programs[0].forward.graph.code, whole.programs[0].forward.graph.code)


if __name__ == "__main__":
    unittest.main()
