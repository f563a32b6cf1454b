"""Stages that compile to the same programs are compiled once (`compiler.compile_costs`,
`compile_pipeline(reuse_stages=True)`, `passes/stage_reuse.py`): the reused costs equal those of
compiling every stage, the F, I, W programs of stages with equal fingerprints are the same graphs
up to names, a reused stage's programs carry exactly the names its own compile gives them, and a
pipelined step with reused programs gives the same gradients, bit for bit."""

from __future__ import annotations

import unittest

import pytest
import torch

from zbcompile.compiler import compile_costs, compile_pipeline
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.passes.stage_reuse import graph_fingerprint
from zbcompile.runtime.parallel import batch
from zbcompile.runtime.step.local import LocalRunner
from zbcompile.schedules import make_schedule
from zbcompile.value_names import param_name


# one xdist group: `pytest -n` runs setUpClass's compiles in one worker
@pytest.mark.xdist_group("stage-reuse")
class StageReuseTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=8)
        cls.model = GPT(config)
        tokens = torch.randint(0, 64, (2, 16))
        cls.batch = ((tokens,), {}, tokens.roll(1, 1))
        cls.full = compile_pipeline(cls.model, lm_loss, *cls.batch, stages=4)
        cls.reused = compile_costs(cls.model, lm_loss, *cls.batch, stages=4)
        cls.shared = compile_pipeline(cls.model, lm_loss, *cls.batch, stages=4, reuse_stages=True)

    def test_middle_stages_compile_once(self):
        self.assertEqual(self.reused.representative, (0, 2, 2, 3))

    def test_costs_equal_compiling_every_stage(self):
        self.assertEqual(self.reused.costs, tuple(p.cost for p in self.full.programs))
        self.assertEqual(self.reused.partition.cuts, self.full.partition.cuts)

    def test_reused_stages_have_the_same_programs(self):
        for stage, first in enumerate(self.reused.representative):
            mine, theirs = self.full.programs[stage], self.full.programs[first]
            for graph in ("forward", "input_backward", "weight_backward"):
                self.assertEqual(
                    graph_fingerprint(getattr(mine, graph).graph), graph_fingerprint(getattr(theirs, graph).graph),
                    f"stage {stage} reuses stage {first} but their {graph} graphs differ",
                )

    def test_different_stages_have_different_fingerprints(self):
        fingerprints = [graph_fingerprint(s.module) for s in self.full.partition.stages]
        self.assertEqual(fingerprints[1], fingerprints[2])
        self.assertNotEqual(fingerprints[0], fingerprints[1])  # the embeddings
        self.assertNotEqual(fingerprints[2], fingerprints[3])  # the head and the loss


    def test_reused_programs_carry_their_own_names(self):
        fields = ("forward", "backward", "input_backward", "weight_backward")
        for own, shared in zip(self.full.programs, self.shared.programs):
            for field in fields:
                program = getattr(own.joint if field == "backward" else own, field)
                other = getattr(shared.joint if field == "backward" else shared, field)
                self.assertEqual(program.signature, other.signature, f"stage {own.index} {field}")
                self.assertEqual(graph_fingerprint(program.graph), graph_fingerprint(other.graph))
            for name in ("tangents", "input_grads", "param_grads", "storage", "output_grads", "recomputed"):
                self.assertEqual(getattr(own.joint, name), getattr(shared.joint, name), f"stage {own.index} {name}")
            for name in ("stash", "weight_reads", "input_param_grads", "freed_after_input"):
                self.assertEqual(getattr(own.split, name), getattr(shared.split, name), f"stage {own.index} {name}")
            self.assertEqual(own.cost, shared.cost)

    def test_gradients_equal_compiling_every_stage(self):
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        micro_inputs, micro_targets, _ = batch.split((tokens,), {}, tokens.roll(1, 1), 2)
        state = {param_name(n): p for n, p in self.model.named_parameters()}
        grads = []
        for compiled in (self.full, self.shared):
            schedule = make_schedule("zb-h1", 4, 2)
            runner = LocalRunner(compiled, schedule, state)
            runner.step(*batch.feeds(compiled, micro_inputs, micro_targets))
            grads.append(runner.reduce_grads())
        self.assertEqual(set(grads[0]), set(grads[1]))
        self.assertTrue(all(g.abs().sum() > 0 for g in grads[0].values()), "a gradient is zero: nothing compared")
        for name, grad in grads[0].items():
            self.assertTrue(torch.equal(grad, grads[1][name]), name)


class FingerprintTest(unittest.TestCase):
    def test_names_do_not_count_shapes_do(self):
        from torch import fx

        def graph(width: int, name: str) -> fx.GraphModule:
            module = torch.nn.Linear(width, width)
            traced = fx.symbolic_trace(torch.nn.Sequential(module))
            for node in traced.graph.nodes:
                node.meta["val"] = torch.empty(width)
                if node.op == "placeholder":
                    node.name = name
            return traced

        self.assertEqual(graph_fingerprint(graph(4, "a")), graph_fingerprint(graph(4, "b")))
        self.assertNotEqual(graph_fingerprint(graph(4, "a")), graph_fingerprint(graph(5, "a")))


if __name__ == "__main__":
    unittest.main()
