"""`zbcompile plan --gpus N`: the layout searched (pp x tp x dp x data-parallel mode x microbatch
size x schedule x recomputation) on one compile of the model; the whole menu of a given layout
under its memory limit; the nearest layouts that fit where the given one does not."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import unittest
from dataclasses import replace

import pytest
import torch

import zbcompile
from zbcompile.cli import main
from zbcompile.compiler import compile_costs
from zbcompile.passes.tensor_parallel_shares import annotate_shares, model_plan
from zbcompile.planner.hardware import NAMED
from zbcompile.planner.pricing import MENU, Layout, Pricer, SearchSettings
from zbcompile.planner.search import menu, search
from zbcompile.planner.units import LEVEL_NAMES, _costed_units, compiled_units, for_ranks, model_units
from zbcompile.rehearsal.rehearse import plan_times
from zbcompile.schedules import make_schedule, simulate
from zbcompile.schedules.cut_choice import CutSettings, stage_costs
from zbcompile.schedules.cut_search import Cut, bottleneck_cut
from zbcompile.schedules.cut_units import segments_of
from zbcompile.schedules.memory_limit import state_bytes

H100 = NAMED["H100-80GB"]
SEQ = 64
CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96}


def meta_llama():
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    config.use_cache = False
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return model.train()


def batch_of(b: int):
    tokens = torch.zeros(b, SEQ, dtype=torch.long, device="meta")
    return (tokens,), {"labels": tokens}, None


def settings(limit: float = H100.memory, **changes) -> SearchSettings:
    base = SearchSettings(
        gpus=4, global_batch=8, memory_limit=limit, link_bandwidth=H100.link_bandwidth,
        allreduce_seconds_per_byte=lambda dp: H100.allreduce_seconds(1.0, dp), keep=3,
    )
    return replace(base, **changes)


@pytest.mark.xdist_group("plan")
class LayoutSearchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = meta_llama()
        cls.plan = model_plan(cls.model, None)
        cls.units = model_units(cls.model, batch_of, H100, (1, 2, 4), cls.plan)

    def tight_limit(self) -> float:
        """A limit under which the unconstrained best layout's option no longer fits."""
        return 0.9 * max(search(self.units, settings()).best.peaks)

    def test_the_search_picks_what_pricing_every_option_picks(self):
        """Branch and bound stops where the bound passes the kept layouts' steps; pricing every
        option of every layout ranks the same layouts first, with and without a binding limit."""
        for limit in (H100.memory, self.tight_limit()):
            found = search(self.units, settings(limit))
            every = search(self.units, settings(limit), exhaustive=True)
            self.assertEqual([o.key() for o in found.ranked], [o.key() for o in every.ranked])
            self.assertTrue(all(max(o.peaks) <= limit for o in found.ranked))
            self.assertLess(len(found.priced), len(every.priced))

    def test_a_binding_limit_moves_the_choice_and_every_fit_is_within_it(self):
        free, tight = search(self.units, settings()), search(self.units, settings(self.tight_limit()))
        self.assertNotEqual(free.best.key(), tight.best.key())
        self.assertGreater(tight.best.step, free.best.step)
        limit = tight.settings.memory_limit
        for outcome in tight.priced:
            self.assertEqual(outcome.fits, bool(outcome.peaks) and max(outcome.peaks) <= limit, outcome)

    def test_an_option_is_priced_as_its_schedule_simulates_on_its_stages(self):
        """1F1B's best layout, priced again from the public pieces: the model's units for its ranks,
        the least-bottleneck cut, each stage's costs and state, 1F1B made on them and simulated."""
        best = search(self.units, settings(menu=(("1f1b", "in-line"),), levels=(0,))).best
        layout = best.layout
        units = for_ranks(self.units.units(layout.tp, layout.microbatch_size)[0], layout.pp)
        segments = segments_of(units)
        cut = Cut("in-line", bottleneck_cut(segments, layout.pp, "in-line"))
        cut_settings = CutSettings(
            microbatches=layout.microbatches, comm_per_byte=1 / H100.link_bandwidth,
            reduce_per_byte=(1.0 if layout.data_parallel == "replicate" else 0.5) * H100.allreduce_seconds(1.0,
                                                                                                          layout.dp),
            state_per_byte=state_bytes(1.0, layout.dp, layout.data_parallel)["total"],
        )
        costs, state = stage_costs(units, cut, cut_settings, segments)
        unit = max(costs.mem_b)
        scaled = replace(costs, mem_b=[b / unit for b in costs.mem_b], mem_w=[w / unit for w in costs.mem_w])
        result = simulate(make_schedule("1f1b", layout.pp, layout.microbatches, scaled), scaled)
        self.assertAlmostEqual(result.span, best.step, delta=1e-12)
        self.assertEqual(best.peaks, tuple(s + p * unit for s, p in zip(state, result.peak_memory)))

    def test_microbatch_sizes_between_the_compiled_ones_are_affine(self):
        """The units at 3 samples per microbatch, derived from the compiles at 2 and 4, match a
        compile at 3 (every pass's FLOPs, bytes and activations are affine in the samples)."""
        args, kwargs, target = batch_of(3)
        costed = compile_costs(self.model, None, args, kwargs, target, 4, device=torch.device("cpu"))
        three = _costed_units(costed, H100)
        derived = self.units.units(1, 3)[0]
        self.assertEqual(derived.positions, three.positions)
        for got, want in zip((*derived.times[0], derived.mem_b, derived.mem_w, derived.crossing),
                             (*three.times[0], three.mem_b, three.mem_w, three.crossing)):
            self.assertAlmostEqual(sum(got), sum(want), delta=1e-6 * sum(want))

    def test_other_tensor_parallel_degrees_are_derived_from_two(self):
        """Each node's FLOPs and bytes on one rank are whole or 1/tp, so tp = 2 follows from the
        compiles at tp = 1 and 4: F and I + W as a compile at tp = 2 gives them, collectives
        included, and each parameter's bytes; M_B and M_W within what the I/W split (chosen by
        intensity, which tp changes) moves."""
        args, kwargs, target = batch_of(2)
        for tp in (2, 4):
            costed = compile_costs(self.model, None, args, kwargs, target, 4, device=torch.device("cpu"),
                                   annotate=lambda traced, tp=tp: annotate_shares(traced, self.plan, tp))
            compiled = compiled_units(costed, H100, tp, 2).units(tp, 2)[0]
            derived = self.units.units(tp, 2)[0]
            self.assertEqual([b for b, _ in derived.params], [b for b, _ in compiled.params])
            (f, i, w), (cf, ci, cw) = derived.times[0], compiled.times[0]
            exact = 1e-9 if tp == 4 else 0.01  # a node's bytes round to whole bytes at each tp
            self.assertAlmostEqual(sum(f), sum(cf), delta=exact * sum(cf))
            self.assertAlmostEqual(sum(i) + sum(w), sum(ci) + sum(cw), delta=exact * (sum(ci) + sum(cw)))
            for got, want in ((derived.mem_b, compiled.mem_b), (derived.mem_w, compiled.mem_w)):
                self.assertAlmostEqual(sum(got), sum(want), delta=(0.1 if tp == 2 else 1e-9) * sum(want))

    def test_layouts_the_model_cannot_take_are_dropped_with_the_reason(self):
        found = zbcompile.plan(self.model, *batch_of(8)[0], labels=batch_of(8)[0][0], gpus=8)
        reasons = " | ".join(f"{what}: {why}" for what, why in found.result.dropped)
        self.assertIn("tp=4: the config's num_key_value_heads=2 is not a multiple of tp=4", reasons)
        self.assertIn("the global batch 8 is not a multiple of dp", reasons)
        best = found.best.layout
        self.assertEqual(best.pp * best.tp * best.dp, 8)
        text = str(found)
        self.assertIn(f"layouts of 8 x H100-80GB (8 per node) for a global batch of 8 samples ({SEQ} tokens each)",
                      text)
        self.assertIn("dropped:", text)
        with self.assertRaisesRegex(ValueError, "give no stages, microbatches, dp or tp"):
            zbcompile.plan(self.model, *batch_of(8)[0], gpus=8, stages=2)

    def test_a_solved_schedule_recomputes_per_stage_where_that_is_faster(self):
        """Under a limit where zb-auto fits only with recomputation, the menu also prices it with
        each stage's level lowered where memory allows (`Pricer.mixed_levels`): it fits, beats
        every level for all stages, recomputes less somewhere, and each stage costs what its own
        level's stage costs say (all stages at one level: exactly the uniform option's price)."""
        layout = Layout(4, 1, 1, "replicate", 1, 8)
        limit = 0.6 * max(search(self.units, settings()).best.peaks)
        priced = menu(self.units, settings(limit), layout)
        own = [o for o in priced if (o.option.schedule, o.option.placement) == ("zb-auto", "in-line") and o.fits]
        mixed = [o for o in own if o.option.stage_levels and o.option.cut != "recompute"]
        self.assertEqual(len(mixed), 1, own)
        mixed = mixed[0]
        uniform = [o for o in own if not o.option.stage_levels]
        self.assertTrue(uniform and all(mixed.step < o.step for o in uniform), own)
        self.assertTrue(max(mixed.peaks) <= limit)
        levels = mixed.option.stage_levels
        self.assertEqual(max(levels), mixed.option.level)
        self.assertLess(min(levels), mixed.option.level)
        pricer = Pricer(self.units, settings(limit))
        cut = pricer.cut(layout, mixed.option)
        costs, _ = pricer.stage_costs(layout, mixed.option, cut)
        for stage, level in enumerate(levels):
            own_costs, _ = pricer.stage_costs(layout, replace(mixed.option, stage_levels=(), level=level), cut)
            self.assertEqual((costs.f[stage], costs.i[stage], costs.w[stage], costs.mem_b[stage]),
                             (own_costs.f[stage], own_costs.i[stage], own_costs.w[stage], own_costs.mem_b[stage]))
        same = replace(mixed.option, stage_levels=(mixed.option.level,) * cut.stages)
        plain = replace(mixed.option, stage_levels=())
        self.assertEqual(pricer.price(layout, same, cut, 0.0).step, pricer.price(layout, plain, cut, 0.0).step)
        # not refined (what the layout search prices): the uniform levels alone, each priced as in the whole menu
        coarse = menu(self.units, settings(limit), layout, refined=False)
        uniform = {(o.option, o.step) for o in priced if not o.option.stage_levels and o.option.cut != "recompute"}
        self.assertEqual({(o.option, o.step) for o in coarse}, uniform)


@pytest.mark.xdist_group("plan")
class MenuTest(unittest.TestCase):
    def test_every_schedule_is_listed_with_its_memory_and_the_fastest_fitting_chosen(self):
        """Under a limit below the least peak on the menu, 1F1B does not fit; the menu lists
        every schedule with and without the recomputation that fits, chooses the fastest that
        fits, and says that 1F1B does not."""
        model = meta_llama()
        tokens = batch_of(8)[0][0]
        free = zbcompile.plan(model, tokens, labels=tokens, stages=2, microbatches=4, schedules=("1f1b", "v-half"))
        v_half = next(e for e in free.record["schedules"] if e["name"] == "v-half")  # two chunks on one rank
        self.assertEqual(len(v_half["peak_bytes"]), 1)
        self.assertGreater(v_half["peak_bytes"][0], sum(free.state))  # both chunks' state, and activations
        names = {e["schedule"] for e in free.record["menu"]}
        self.assertEqual(names, {"zb-auto (V)" if (n, p) == ("zb-auto", "v") else n for n, p in MENU})
        limit = 0.8 * min(e["peak_bytes"] for e in free.record["menu"])  # under every peak without recomputation
        tight = zbcompile.plan(model, tokens, labels=tokens, stages=2, microbatches=4, memory_limit=limit)
        menu = tight.record["menu"]
        self.assertFalse(next(e for e in menu if e["schedule"] == "1f1b" and e["recompute"] == "none")["fits"])
        self.assertTrue(any(e["recompute"] != "none" for e in menu), menu)
        self.assertTrue(all(e["recompute"] in LEVEL_NAMES or e["recompute"].startswith("per stage: ") for e in menu))
        fitting = [e for e in menu if e["fits"]]
        self.assertTrue(fitting)
        self.assertTrue(all(e["peak_bytes"] <= limit for e in fitting))
        self.assertEqual(tight.record["menu_choice"], min(fitting, key=lambda e: e["step"]))
        self.assertIn("1F1B itself does not fit", str(tight))
        # `zbcompile rehearse` runs the menu's choice as made: its actions on its own per-chunk times
        rehearsed = {p.name: p for p in plan_times(json.loads(json.dumps(tight.record, default=str))).given}
        choice = tight.record["menu_choice"]
        made = rehearsed[f"menu: {choice['schedule']}"]
        self.assertEqual(made.extra["recompute"], choice["recompute"])
        self.assertAlmostEqual(simulate(made.schedule, made.costs).span, choice["step"], delta=1e-12)

    def test_a_layout_that_fits_nothing_names_the_nearest_that_do(self):
        """Under a limit just below the least state a rank holds in two stages, the two-stage
        layout fits nothing (no schedule's peak is below its state) and the plan names the nearest
        layouts of as many GPUs that do (with short sequences state outweighs activations, so more
        stages or tensor-parallel ranks, each holding less of it, fit)."""
        model = meta_llama()
        tokens = torch.zeros(4, 8, dtype=torch.long, device="meta")  # short sequences: state outweighs activations
        two = zbcompile.plan(model, tokens, labels=tokens, stages=2, microbatches=4, dp=2)
        limit = 0.99 * min(row["state"]["total"] for row in two.record["stage_rows"])
        planned = zbcompile.plan(model, tokens, labels=tokens, stages=2, microbatches=4, dp=2, memory_limit=limit)
        self.assertIsNone(planned.record["menu_choice"])
        nearest = planned.record["nearest"]
        self.assertTrue(nearest, planned.record)
        self.assertTrue(all(o["pp"] * o["tp"] * o["dp"] == 4 and o["peak_bytes"] <= limit for o in nearest))
        self.assertIn("nearest layouts of as many GPUs that fit", str(planned))


class SearchCommandTest(unittest.TestCase):
    def test_gpus_and_global_batch(self):
        with tempfile.TemporaryDirectory() as root:
            path = os.path.join(root, "config.json")
            with open(path, "w") as file:
                json.dump(CONFIG, file)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(["plan", path, "--gpus", "4", "--global-batch", "8", "--seq-len", str(SEQ), "--json",
                             os.path.join(root, "search.json")])
                refused = main(["plan", path, "--gpus", "4"])
                both = main(["plan", path, "--gpus", "4", "--global-batch", "8", "--stages", "2"])
            self.assertEqual(code, 0, err.getvalue())
            self.assertIn("layouts of 4 x H100-80GB", out.getvalue())
            with open(os.path.join(root, "search.json")) as file:
                record = json.load(file)
            self.assertTrue(record["layouts"])
            self.assertEqual((refused, both), (2, 2))
            self.assertIn("give --global-batch", err.getvalue())
            self.assertIn("drop --stages", err.getvalue())


if __name__ == "__main__":
    unittest.main()
