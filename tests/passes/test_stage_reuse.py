"""Stages that compile to the same programs are compiled once (`compiler.compile_costs`,
`passes/stage_reuse.py`): the reused costs equal those of compiling every stage, and the F, I, W
programs of stages with equal fingerprints are the same graphs up to names."""

from __future__ import annotations

import unittest

import torch

from zbcompile.compiler import compile_costs, compile_pipeline
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.passes.stage_reuse import graph_fingerprint


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
