"""`zbcompile.plan(tp=...)`: tensor parallelism planned from the whole model's trace (no process
group): each rank's share of the plan's parameters, FLOPs and activations, and the collectives'
time on the hardware's intra-node bandwidth, in F and I only; a transformers model's own plan by
default (`zbcompile plan --tp`); bad plans named."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import unittest

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import zbcompile
from zbcompile.cli import main
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.planner.hardware import NAMED, Hardware

PLAN = {
    "blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
    "blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": "rowwise",  # transformers' word for it
}
COLWISE = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias")
ROWWISE_WEIGHTS = ("attn.proj.weight", "mlp.proj.weight")
ACTIVATION = 2 * 16 * 32 * 4  # bytes of one microbatch's hidden states: 2 sequences x 16 tokens x 32 floats


def meta_gpt() -> tuple[torch.nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=6))
    return model, torch.zeros(8, 16, dtype=torch.long, device="meta")


def planned(tp: int, **options):
    model, tokens = meta_gpt()
    return model, zbcompile.plan(
        model, tokens, target=tokens, loss_fn=lm_loss, stages=3, microbatches=4, hardware="H100-80GB",
        split_points=["blocks.2", "blocks.4"], tp=tp, tensor_parallel=PLAN if tp > 1 else None, **options,
    )


@pytest.mark.xdist_group("plan")
class TensorParallelPlanTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model, cls.whole = planned(1)
        _, cls.split = planned(2)

    def test_each_rank_holds_half_the_plans_parameters(self):
        """Per stage: the column-wise modules' weights and biases and the row-wise weights
        halved; embeddings, norms, row-wise biases and the head whole."""
        params = dict(self.model.named_parameters())
        for before, after in zip(self.whole.record["stage_rows"], self.split.record["stage_rows"], strict=True):
            sharded = sum(
                params[f].numel() * params[f].element_size()
                for f in before["param_fqns"] if f.endswith(COLWISE + ROWWISE_WEIGHTS)
            )
            self.assertGreater(sharded, 0)
            self.assertEqual(after["held_param_bytes"], before["held_param_bytes"] - sharded // 2)
            self.assertEqual(after["state"]["total"], 4 * after["held_param_bytes"])  # AdamW, replicate, dp=1

    def test_the_blocks_flops_and_activations_about_halve(self):
        before, after = self.whole.record["stage_rows"][1], self.split.record["stage_rows"][1]
        for kind in ("F", "I", "W"):
            self.assertLess(after["flops"][kind], 0.6 * before["flops"][kind], kind)
            self.assertGreater(after["flops"][kind], 0.45 * before["flops"][kind], kind)
        self.assertLess(after["mem_b"], before["mem_b"])

    def test_collectives_are_counted_in_f_and_i_on_the_intra_node_bandwidth(self):
        """A middle stage's two blocks: 4 row-wise outputs all-reduced in F, 4 column-wise inputs'
        gradients all-reduced in I, each of one microbatch's hidden states; nothing in W."""
        hw = NAMED["H100-80GB"]
        one = hw.intra_node_seconds("all_reduce", ACTIVATION, 2)
        self.assertAlmostEqual(one, ACTIVATION / hw.intra_node_bandwidth)  # 2 (tp - 1) / tp = 1
        row = self.split.record["stage_rows"][1]
        self.assertEqual(set(row["tp_seconds"]), {"F", "I"})
        self.assertAlmostEqual(row["tp_seconds"]["F"], 4 * one)
        self.assertAlmostEqual(row["tp_seconds"]["I"], 4 * one)
        cost = self.split.costed.costs[1]
        self.assertAlmostEqual(row["seconds"]["F"], hw.pass_seconds(cost.forward, "F") + 4 * one)
        self.assertAlmostEqual(row["seconds"]["W"], hw.pass_seconds(cost.weight_backward, "W"))
        text = str(self.split)
        self.assertIn("dp=1 (replicate), tp=2", text)
        self.assertIn("tensor parallelism: tp=2 ranks per stage", text)

    def test_sequence_parallelism_shards_the_rest_of_the_activations(self):
        _, sequence = planned(2, sequence_parallel=True)
        row, plain = sequence.record["stage_rows"][1], self.split.record["stage_rows"][1]
        self.assertLess(row["mem_b"], plain["mem_b"])
        # an all-gather and a reduce-scatter move as many bytes as one all-reduce
        self.assertAlmostEqual(row["tp_seconds"]["F"], plain["tp_seconds"]["F"])
        self.assertTrue(sequence.record["sequence_parallel"])

    def test_bad_plans_name_themselves(self):
        model, tokens = meta_gpt()
        common = dict(target=tokens, loss_fn=lm_loss, stages=2, microbatches=2)
        with self.assertRaisesRegex(ValueError, r"'blocks\.\*\.attn\.q_proj', which GPT does not have \(tp=2\)"):
            zbcompile.plan(model, tokens, tp=2, tensor_parallel={"blocks.*.attn.q_proj": "colwise"}, **common)
        with self.assertRaisesRegex(ValueError, "GPT has no tensor-parallel plan of its own"):
            zbcompile.plan(model, tokens, tp=2, **common)
        with self.assertRaisesRegex(ValueError, "tp must be a positive int"):
            zbcompile.plan(model, tokens, tp=0, **common)


class TensorParallelHardwareTest(unittest.TestCase):
    def test_intra_node_collectives_and_json(self):
        hw = Hardware(flops=1e12, memory_bandwidth=1e12, link_bandwidth=1e9, memory=1e9, intra_node_bandwidth=4e9)
        self.assertAlmostEqual(hw.intra_node_seconds("all_reduce", 8e9, 4), 2 * 3 / 4 * 8e9 / 4e9)
        self.assertAlmostEqual(hw.intra_node_seconds("all_gather", 8e9, 4), 3 / 4 * 8e9 / 4e9)
        self.assertEqual(hw.intra_node_seconds("all_reduce", 8e9, 1), 0.0)
        self.assertEqual(Hardware.from_dict(hw.to_dict()), hw)
        without = Hardware(flops=1e12, memory_bandwidth=1e12, link_bandwidth=1e9, memory=1e9)
        self.assertAlmostEqual(without.intra_node_seconds("all_gather", 1e9, 2), 0.5)  # the link's bandwidth
        with self.assertRaisesRegex(ValueError, "intra_node_bandwidth must be a positive"):
            Hardware(flops=1e12, memory_bandwidth=1e12, link_bandwidth=1e9, memory=1e9, intra_node_bandwidth=0)


class TensorParallelCommandTest(unittest.TestCase):
    def test_transformers_model_plans_with_its_own_tp_plan(self):
        config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96}
        records = {}
        with tempfile.TemporaryDirectory() as root:
            path = os.path.join(root, "config.json")
            with open(path, "w") as file:
                json.dump(config, file)
            for tp in ("1", "2"):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    code = main([
                        "plan", path, "--stages", "2", "--microbatches", "2", "--seq-len", "8", "--tp", tp,
                        "--schedules", "1f1b", "--json", os.path.join(root, f"{tp}.json"),
                    ])
                self.assertEqual(code, 0)
                with open(os.path.join(root, f"{tp}.json")) as file:
                    records[tp] = json.load(file)
        self.assertIn("tensor parallelism: tp=2", out.getvalue())
        for whole, split in zip(records["1"]["stage_rows"], records["2"]["stage_rows"], strict=True):
            self.assertLess(split["held_param_bytes"], 0.75 * whole["held_param_bytes"])
            self.assertGreater(split["tp_seconds"]["I"], 0)
