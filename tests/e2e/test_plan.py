"""`zbcompile.plan()` and `zbcompile plan`: a model on the meta device planned without
materialising a parameter; memory per rank is state plus activations and decides what fits;
hardware profiles by name, from JSON and calibrated from measured times."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import tempfile
import unittest

import pytest
import torch

import zbcompile
from zbcompile.cli import main
from zbcompile.models import GPT, GPTConfig
from zbcompile.models.gpt import lm_loss
from zbcompile.passes.graph_cost import GraphCost
from zbcompile.planner.hardware import NAMED, Hardware
from zbcompile.planner.plan import PlanOptions, _zb_auto_choice, plan_compiled
from zbcompile.planner.report import zb_auto_line
from zbcompile.rehearsal.rehearse import plan_times
from zbcompile.schedules import Costs, simulate
from zbcompile.schedules.memory_limit import state_bytes


class HardwareTest(unittest.TestCase):
    def test_named_profiles_and_json_round_trip(self):
        self.assertEqual(set(NAMED), {"A100-80GB", "H100-80GB", "H200"})
        self.assertGreater(NAMED["H200"].memory, NAMED["H100-80GB"].memory)
        with tempfile.TemporaryDirectory() as root:
            path = os.path.join(root, "gpu.json")
            NAMED["H100-80GB"].save(path)
            self.assertEqual(Hardware.load(path), NAMED["H100-80GB"])
        with self.assertRaisesRegex(ValueError, "unknown hardware 'B999'.*H100-80GB"):
            Hardware.named("B999")
        with self.assertRaisesRegex(TypeError, "unknown keys \\['tflops'\\]"):
            Hardware.from_dict({"tflops": 1})
        with self.assertRaisesRegex(ValueError, "efficiency is a share of peak"):
            Hardware(flops=1e12, memory_bandwidth=1e12, link_bandwidth=1e9, memory=1e9, efficiency=2.0)

    def test_from_measured_recovers_the_efficiencies_that_made_the_times(self):
        truth = Hardware(
            flops=1e12,
            memory_bandwidth=1e11,
            link_bandwidth=1e9,
            memory=1e9,
            pass_efficiency={"F": 0.5, "I": 0.4, "W": 0.8},
        )
        static = [{k: GraphCost(flops=f * 10**9, written_bytes=b * 10**6) for k, (f, b) in zip("FIW", work)}
                  for work in ([(3, 5), (4, 9), (2, 1)], [(6, 2), (5, 3), (4, 4)])]
        measured = Costs(
            **{k.lower(): [truth.pass_seconds(stage[k], k) for stage in static] for k in "FIW"}, comm=0.002
        )
        fitted = Hardware.from_measured(measured, static, like=truth, boundary_bytes=[4e6])
        for kind in "FIW":
            self.assertAlmostEqual(fitted.efficiency_of(kind), truth.efficiency_of(kind), places=12)
        self.assertAlmostEqual(fitted.link_bandwidth, 2e9)

    def test_state_bytes_by_data_parallel_mode(self):
        replicate = state_bytes(100.0, 4, "replicate")
        self.assertEqual((replicate["params"], replicate["grads"], replicate["optimizer"]), (100.0, 100.0, 200.0))
        shard = state_bytes(100.0, 4, "shard")
        self.assertEqual((shard["params"], shard["grads"], shard["optimizer"]), (125.0, 125.0, 50.0))
        with self.assertRaisesRegex(ValueError, "data_parallel must be one of"):
            state_bytes(1.0, 2, "zero")


def meta_gpt() -> tuple[torch.nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=6))
    return model, torch.zeros(8, 16, dtype=torch.long, device="meta")


# one xdist group: `pytest -n` runs setUpClass's compiles in one worker
@pytest.mark.xdist_group("plan")
class PlanTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model, tokens = meta_gpt()
        cls.plan = zbcompile.plan(
            cls.model, tokens, target=tokens, loss_fn=lm_loss, stages=3, microbatches=4, dp=2, hardware="A100-80GB"
        )

    def test_nothing_is_materialised(self):
        self.assertTrue(all(p.is_meta for p in self.model.parameters()))

    def test_every_schedule_has_peaks_fit_and_times(self):
        names = [e["name"] for e in self.plan.record["schedules"]]
        self.assertEqual(names, ["1f1b", "zb-h1", "zb-h2", "gpipe", "zb-auto"])
        for entry in self.plan.record["schedules"]:
            self.assertEqual(len(entry["peak_bytes"]), 3)
            self.assertTrue(entry["fits"])  # kilobytes against 80 GB
            self.assertGreater(entry["span"], 0)
            # each rank: its state plus activations of at least one microbatch
            for rank, peak in enumerate(entry["peak_bytes"]):
                self.assertGreater(peak, self.plan.state[rank] + self.plan.costed.costs[rank].mem_b * 0.99)
        text = str(self.plan)
        for expected in ("zb-auto would choose", "state per rank (replicate, dp=2", "tok_emb, pos_emb, blocks.0"):
            self.assertIn(expected, text)
        self.assertIn('<rect class="action W"', self.plan.svg("zb-auto"))

    def test_predicted_times_follow_the_hardware(self):
        row = self.plan.record["stage_rows"][1]
        cost = self.plan.costed.costs[1].forward
        hw = NAMED["A100-80GB"]
        self.assertAlmostEqual(
            row["seconds"]["F"], (cost.flops / hw.flops + cost.written_bytes / hw.memory_bandwidth) / hw.efficiency
        )

    def test_on_other_hardware_replans_the_same_compile(self):
        """plan.on(hardware) plans the same compile again: at half the efficiency every stage's
        predicted F, I and W take twice as long; the SVG written is the one svg() gives."""
        hw = NAMED["A100-80GB"]
        replanned = self.plan.on(dataclasses.replace(hw, efficiency=hw.efficiency / 2))
        self.assertIs(replanned.costed, self.plan.costed)
        for before, after in zip(self.plan.record["stage_rows"], replanned.record["stage_rows"], strict=True):
            for kind in ("F", "I", "W"):
                self.assertAlmostEqual(after["seconds"][kind], 2 * before["seconds"][kind])
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "timeline.svg")
            replanned.write_svg("zb-auto", path)
            with open(path) as file:
                self.assertEqual(file.read(), replanned.svg("zb-auto"))

    def test_each_stages_gradient_reduction_is_counted_after_its_last_w(self):
        """dp=2: each stage's reduction is a ring all-reduce of its gradients over the link
        (a reduce-scatter, half of it, under "shard"), and every schedule's predicted span
        includes the tail; with dp=1 there is none."""
        hw = NAMED["A100-80GB"]
        rows = self.plan.record["stage_rows"]
        expected = [hw.allreduce_seconds(r["param_bytes"], 2) for r in rows]
        self.assertEqual(list(self.plan.costs.reduce), expected)
        self.assertTrue(all(t > 0 for t in expected))
        for entry in self.plan.record["schedules"]:
            schedule = self.plan.schedules[entry["name"]]
            with_tail = simulate(schedule, self.plan.costs)
            without = simulate(schedule, dataclasses.replace(self.plan.costs, reduce=0.0))
            self.assertEqual(entry["span"], with_tail.span)
            self.assertGreater(with_tail.span, without.span)  # rank 0's last W ends its compute
            self.assertEqual(entry["reduce_seconds"], expected)  # what `zbcompile rehearse` emulates
        # the rehearsal of the record runs each schedule on the plan's costs, reductions included
        for prepared in plan_times(json.loads(json.dumps(self.plan.record, default=str))).given:
            span = simulate(prepared.schedule, prepared.costs).span
            self.assertAlmostEqual(span, prepared.extra["plan_s"], delta=1e-12)
        self.assertIn("counted in the times above, after the stage's last W", str(self.plan))
        shard = plan_compiled(
            self.plan.costed, hw, PlanOptions(microbatches=4, dp=2, data_parallel="shard", schedules=("1f1b",))
        )
        self.assertEqual(list(shard.costs.reduce), [t / 2 for t in expected])
        single = plan_compiled(self.plan.costed, hw, PlanOptions(microbatches=4, dp=1, schedules=("1f1b",)))
        self.assertFalse(any(single.costs.reduce))

    def test_state_per_rank_is_what_torch_holds_after_an_adamw_step(self):
        """Measured, not modelled: the same GPT materialised and compiled in one process (the same
        cut), one step and one AdamW step; per stage, the bytes of its parameters, their .grad and
        AdamW's two moments as torch holds them equal the plan's state (dp=2 "replicate": whole)."""
        torch.manual_seed(0)
        model = GPT(self.model.config)
        pipe = zbcompile.pipeline(model, stages=3, microbatches=4, loss_fn=lm_loss, schedule="1f1b")
        tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
        pipe.step(tokens, target=tokens)
        optimizer = torch.optim.AdamW(pipe.parameters())
        optimizer.step()
        params = dict(model.named_parameters())
        for stage, row in zip(pipe.compiled.partition.stages, self.plan.record["stage_rows"]):
            self.assertEqual(sorted(stage.param_fqns), sorted(row["param_fqns"]))
            held = 0
            for fqn in stage.param_fqns:
                p = params[fqn]
                moments = (optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
                held += sum(t.numel() * t.element_size() for t in (p, p.grad, *moments))
            self.assertEqual(held, self.plan.state[stage.index], stage.index)

    def test_a_small_memory_limit_decides_what_fits(self):
        zb_h2 = next(e for e in self.plan.record["schedules"] if e["name"] == "zb-h2")
        one_f_one_b = next(e for e in self.plan.record["schedules"] if e["name"] == "1f1b")
        limit = (max(zb_h2["peak_bytes"]) + max(one_f_one_b["peak_bytes"])) / 2
        self.assertLess(max(one_f_one_b["peak_bytes"]), limit)
        options = PlanOptions(microbatches=4, dp=2, memory_limit=limit, schedules=("1f1b", "zb-h2", "zb-auto"))
        tight = plan_compiled(self.plan.costed, NAMED["A100-80GB"], options)  # the same compile, re-planned
        fits = {e["name"]: e["fits"] for e in tight.record["schedules"]}
        self.assertEqual(fits, {"1f1b": True, "zb-h2": False, "zb-auto": True})

    def test_zb_auto_is_not_chosen_where_its_best_schedule_does_not_fit(self):
        """zb-auto's schedule is solved under the memory each rank has left, but its actions' own
        peaks can still pass the limit: the report then says it would choose nothing, by how much
        and where, instead of choosing it."""
        planned = {e["name"]: e for e in self.plan.record["schedules"]}
        limit = max(planned["zb-auto"]["peak_bytes"]) * 0.999  # just below zb-auto's peak
        entries = [{**planned["zb-auto"], "fits": False}, planned["1f1b"]]
        choice = _zb_auto_choice(entries, limit)
        rank = planned["zb-auto"]["peak_bytes"].index(max(planned["zb-auto"]["peak_bytes"]))
        self.assertRegex(choice["error"], rf"peaks at .* on rank {rank}, over the .* per rank by .*; plan more stages")
        self.assertIn("would choose nothing", zb_auto_line({"zb_auto": choice}))
        self.assertNotIn("error", _zb_auto_choice([planned["zb-auto"], planned["1f1b"]], limit / 0.999))

    def test_bad_options_name_themselves(self):
        model, tokens = meta_gpt()
        with self.assertRaisesRegex(ValueError, "data_parallel must be one of"):
            zbcompile.plan(model, tokens, stages=2, microbatches=2, data_parallel="zero")
        with self.assertRaisesRegex(ValueError, "does not split into microbatches=3"):
            zbcompile.plan(model, tokens, stages=2, microbatches=3)


def meta_mixtral(layers: int = 4) -> tuple[torch.nn.Module, torch.Tensor]:
    """A tiny Mixtral (four experts, top two) on the meta device and a batch of token ids."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    return model, torch.zeros(8, 8, dtype=torch.long, device="meta")


@pytest.mark.xdist_group("plan")
class PlanCutTest(unittest.TestCase):
    def test_a_cut_moves_for_memory_on_a_small_mixture_of_experts(self):
        """Without a binding limit the plan keeps the compiler's cut (balanced by FLOPs); under a
        limit that leaves its heavier rank little room, the cut moves to where the predicted step
        under the limit is shorter: zb-auto fits there and is faster than on the compiler's cut
        under the same limit."""
        model, tokens = meta_mixtral()
        free = zbcompile.plan(model, tokens, labels=tokens, stages=2, microbatches=4)
        self.assertNotIn("cut", free.record)
        limit = 1.25e6  # bytes per rank: state ~0.95 MB each, one microbatch ~0.15 MB with transients
        tight = zbcompile.plan(model, tokens, labels=tokens, stages=2, microbatches=4, memory_limit=limit)
        cut = tight.record["cut"]
        self.assertTrue(cut["why"].startswith("moved"), cut)
        self.assertEqual(cut["compiled"], list(free.costed.partition.cuts))
        self.assertNotEqual(tight.costed.partition.cuts, free.costed.partition.cuts)
        self.assertEqual(list(tight.costed.partition.cuts), cut["chosen"])
        on_flop_cut = plan_compiled(free.costed, "H100-80GB", PlanOptions(4, memory_limit=limit))
        moved, kept = (next(e for e in p.record["schedules"] if e["name"] == "zb-auto") for p in (tight, on_flop_cut))
        self.assertTrue(moved["fits"] and all(peak <= limit for peak in moved["peak_bytes"]))
        self.assertLess(moved["span"], kept["span"] if kept.get("fits") else float("inf"))
        self.assertIn("cut: moved", str(tight))

    def test_ranks_of_different_kinds_get_work_by_their_speed(self):
        """One A100 beside an H100 (a third of its FLOP/s): the plan times each stage on its
        rank's hardware and moves work off the slower rank; a list of the wrong length is refused."""
        model, tokens = meta_gpt()
        hardware = ["H100-80GB", "A100-80GB"]
        plan = zbcompile.plan(
            model, tokens, target=tokens, loss_fn=lm_loss, stages=2, microbatches=4, hardware=hardware
        )
        self.assertEqual([h["name"] for h in plan.record["rank_hardware"]], hardware)
        alike = zbcompile.plan(model, tokens, target=tokens, loss_fn=lm_loss, stages=2, microbatches=4)
        self.assertGreater(plan.costed.partition.cuts[0], alike.costed.partition.cuts[0])
        busy = [sum(row["seconds"].values()) for row in plan.record["stage_rows"]]
        on_flop_cut = plan_compiled(alike.costed, hardware, PlanOptions(4))
        busy_before = [sum(row["seconds"].values()) for row in on_flop_cut.record["stage_rows"]]
        self.assertLess(max(busy) / min(busy), max(busy_before) / min(busy_before))
        self.assertIn("per rank: 0 H100-80GB, 1 A100-80GB", str(plan))
        with self.assertRaisesRegex(ValueError, "3 profiles for 2 pipeline ranks"):
            zbcompile.plan(model, tokens, target=tokens, loss_fn=lm_loss, stages=2, microbatches=4, hardware=[
                "H100-80GB"] * 3)


class PlanCommandTest(unittest.TestCase):
    def test_config_json(self):
        config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96}
        with tempfile.TemporaryDirectory() as root:
            path = os.path.join(root, "config.json")
            with open(path, "w") as file:
                json.dump(config, file)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main(
                    [
                        "plan",
                        path,
                        "--stages",
                        "2",
                        "--microbatches",
                        "4",
                        "--seq-len",
                        "8",
                        "--dp",
                        "2",
                        "--hardware",
                        "H200",
                        "--svg",
                        os.path.join(root, "t.svg"),
                        "--json",
                        os.path.join(root, "p.json"),
                    ]
                )
            self.assertEqual(code, 0)
            self.assertIn("plan: LlamaForCausalLM, 2 stages", out.getvalue())
            self.assertIn("model.embed_tokens, model.layers.0", out.getvalue())
            with open(os.path.join(root, "p.json")) as file:
                self.assertEqual(len(json.load(file)["stage_rows"]), 2)
            self.assertTrue(os.path.getsize(os.path.join(root, "t.svg")) > 0)

    def test_factory(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(
                [
                    "plan",
                    "helpers.plan_factories:tiny_gpt",
                    "--stages",
                    "2",
                    "--microbatches",
                    "2",
                    "--schedules",
                    "1f1b,zb-auto",
                ]
            )
        self.assertEqual(code, 0)
        self.assertIn("plan: GPT, 2 stages, 2 microbatches of (2, 16)", out.getvalue())
        self.assertIn("zb-auto would choose: zb-auto", out.getvalue())

    def test_unknown_model_is_refused(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(main(["plan", "nothing_here", "--stages", "2", "--microbatches", "2"]), 2)
        self.assertIn("neither a config.json nor module:function", err.getvalue())


if __name__ == "__main__":
    unittest.main()
