"""The B/W split: B then W reproduces the unsplit backward bit for bit; B holds no
weight-gradient work; the graphs of one transformer block read as expected."""

from __future__ import annotations

import operator

import torch
from expecttest import TestCase
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from zbcompile.compiler import compile_pipeline
from zbcompile.models.gpt import GPT, Block, GPTConfig, lm_loss
from zbcompile.passes.graph_cost import measure_stage_times, node_flops, random_inputs
from zbcompile.passes.split_backward import MIN_DEFERRAL_INTENSITY
from zbcompile.value_names import (
    grad_name,
    is_param_grad,
    is_stash,
    output_name,
    param_grad_name,
    param_name,
    tangent_name,
)

aten = torch.ops.aten


def _compile_gpt(stages: int, layers: int = 4):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=16, heads=4, layers=layers))
    tokens = torch.randint(0, 64, (2, 8))
    return model, compile_pipeline(model, lm_loss, (tokens,), {}, tokens.roll(1, 1), stages)


class SplitReproducesBackward(TestCase):
    def test_every_gpt_stage(self):
        """Run F on real inputs, then the unsplit backward and B followed by W on the same
        values: every gradient is bitwise equal."""
        model, compiled = _compile_gpt(stages=4)
        state = {param_name(n): p.detach() for n, p in model.named_parameters()}
        generator = torch.Generator().manual_seed(1)
        for program in compiled.programs:
            env = random_inputs(program.forward, state, generator)
            program.forward.run(env, state)
            for name in program.joint.tangents:
                shape_source = env.get(output_name(name))
                env[tangent_name(name)] = (
                    torch.randn(shape_source.shape, generator=generator) if name != "loss" else torch.tensor(0.25)
                )
            unsplit = dict(env)
            program.joint.backward.run(unsplit, state)
            split = dict(env)
            program.input_backward.run(split, state)
            program.weight_backward.run(split, state)
            grads = [n for n in program.joint.backward.signature.outputs]
            self.assertTrue(grads, f"stage {program.index} has no gradients")
            for name in grads:
                self.assertTrue(torch.equal(unsplit[name], split[name]), f"stage {program.index}: {name} differs")

    def test_measured_times(self):
        model, compiled = _compile_gpt(stages=2, layers=2)
        state = {param_name(n): p.detach() for n, p in model.named_parameters()}
        times = measure_stage_times(compiled.programs[1], state, repeats=2)
        self.assertGreater(times.forward, 0)
        self.assertGreater(times.input_backward, 0)
        self.assertGreater(times.weight_backward, 0)

    def test_first_stage_input_backward_computes_the_activation_gradients(self):
        """No input of the first stage needs a gradient, yet its I computes the activations'
        gradients as every stage's does: one input-gradient matmul per linear layer in I, one
        weight-gradient matmul per linear layer and the embeddings' backward in W, and the saved
        values only I reads freed after it."""
        _, compiled = _compile_gpt(stages=2)
        first = compiled.programs[0]
        b, w = first.input_backward, first.weight_backward
        linears = sum(1 for o in w.signature.outputs if o.endswith(".bias"))  # norms' are I's; embeddings have none
        self.assertGreater(linears, 0)
        self.assertEqual(len(_calls(b, aten.mm.default)), linears)
        self.assertEqual(len(_calls(w, aten.mm.default)), linears)
        self.assertEqual(len(_calls(w, aten.embedding_dense_backward.default)), 2)
        self.assertEqual(_calls(b, aten.embedding_dense_backward.default), [])
        self.assertFalse([o for o in b.signature.outputs if not is_stash(o) and not is_param_grad(o)])
        self.assertTrue([v for v in first.split.freed_after_input if v.startswith("saved:")])
        self.assertFalse(set(first.split.freed_after_input) & set(first.split.weight_reads))

    def test_values_only_b_needs_are_freed_after_b(self):
        _, compiled = _compile_gpt(stages=2)
        last = compiled.programs[-1]
        freed = set(last.split.freed_after_input)
        self.assertTrue(freed, "the last stage's B should free the loss's saved values")
        self.assertFalse(freed & set(last.split.weight_reads))


def _block_pipeline(hidden: int, seq: int, heads: int, batch: int = 2, defer_all: bool = True):
    """A 3-stage model whose middle stage is exactly one transformer block. `defer_all`: every
    weight gradient goes to W (else the default policy keeps cheap ones in B)."""
    torch.manual_seed(0)
    config = GPTConfig(hidden=hidden, heads=heads, seq_len=seq, layers=1)
    model = nn.Sequential(nn.Linear(hidden, hidden), Block(config), nn.Linear(hidden, hidden))
    x = torch.randn(batch, seq, hidden)
    compiled = compile_pipeline(
        model, nn.functional.mse_loss, (x,), {}, torch.randn(batch, seq, hidden), 3, ["1", "2"],
        min_deferral_intensity=0 if defer_all else MIN_DEFERRAL_INTENSITY,
    )
    return compiled.programs[1]


def _calls(program, target):
    return [n for n in program.graph.graph.nodes if n.op == "call_function" and n.target is target]


class TransformerBlockSplit(TestCase):
    def test_b_has_no_weight_gradient_matmul(self):
        block = _block_pipeline(hidden=8, seq=4, heads=2)
        b, w = block.input_backward, block.weight_backward
        # four Linear layers: one input-gradient matmul each in B, one weight-gradient matmul each in W
        self.assertEqual(len(_calls(b, aten.mm.default)), 4)
        self.assertEqual(len(_calls(w, aten.mm.default)), 4)
        self.assertEqual([o for o in b.signature.outputs if not is_stash(o)], [grad_name("view_1")])
        self.assertFalse([o for o in b.signature.outputs if is_param_grad(o)])

    def test_layer_norm_backward_is_split_by_output_mask(self):
        block = _block_pipeline(hidden=8, seq=4, heads=2)
        for program, mask in (
            (block.input_backward, [True, False, False]),
            (block.weight_backward, [False, True, True]),
        ):
            nodes = _calls(program, aten.native_layer_norm_backward.default)
            self.assertEqual(len(nodes), 2)
            self.assertEqual({tuple(n.args[-1]) for n in nodes}, {tuple(mask)})
        returned = block.weight_backward.signature.outputs
        for fqn in ("1.ln1.weight", "1.ln1.bias", "1.ln2.weight", "1.ln2.bias"):
            self.assertIn(param_grad_name(fqn), returned)

    def test_default_policy_keeps_norm_weight_gradients_in_b(self):
        """Deferring a LayerNorm's weight gradients would keep its input and output-gradient alive
        until W for a few elementwise ops: by default B computes them, and W holds no more than
        F saved (M_W <= M_B, the paper's premise for ZB-H1 at 1F1B's memory)."""
        deferred = _block_pipeline(hidden=64, seq=32, heads=4, defer_all=True)
        default = _block_pipeline(hidden=64, seq=32, heads=4, defer_all=False)
        self.assertEqual(
            set(default.split.input_param_grads), {"1.ln1.weight", "1.ln1.bias", "1.ln2.weight", "1.ln2.bias"}
        )
        self.assertEqual(len(_calls(default.weight_backward, aten.mm.default)), 4)
        self.assertGreater(deferred.cost.mem_w, deferred.cost.mem_b)
        self.assertLessEqual(default.cost.mem_w, default.cost.mem_b)

    def test_weight_backward_holds_40_percent_of_backward_flops(self):
        """The paper's Table 1: W = 24sbh^2 against B = sbh(24h + 8s)."""
        block = _block_pipeline(hidden=256, seq=128, heads=4)
        b = block.cost.input_backward.flops
        w = block.cost.weight_backward.flops
        self.assertGreaterEqual(w / (b + w), 0.40)

    def test_flops_of_f_i_w_are_torchs_count_of_the_eager_step(self):
        """Summed over every stage, the FLOPs of F, I and W equal what torch's FlopCounterMode counts
        for the eager model's forward and backward of the same microbatch: the matmuls exactly, and
        the attention by torch's own formulas for scaled dot-product attention (its counter has
        none for the CPU kernel the graphs hold)."""
        model, compiled = _compile_gpt(stages=2)
        tokens = torch.randint(0, 64, (2, 8))
        with FlopCounterMode(display=False) as counter:
            lm_loss(model(tokens), tokens.roll(1, 1)).backward()
        attention = forward_attention = 0
        ours = 0
        for program in compiled.programs:
            for graph in (program.forward, program.input_backward, program.weight_backward):
                for node in graph.graph.graph.nodes:
                    if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
                        q, k, v = (a.meta["val"].shape for a in node.args[:3])
                        attention += flop_counter.sdpa_flop_count(q, k, v)
                        forward_attention += 1
                    elif node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
                        q, k, v = (a.meta["val"].shape for a in node.args[1:4])
                        attention += flop_counter.sdpa_backward_flop_count(node.args[0].meta["val"].shape, q, k, v)
                    else:
                        ours += node_flops(node)
        self.assertEqual(forward_attention, 4)  # one per layer
        self.assertEqual(ours, counter.get_total_flops())
        total = sum(p.cost.forward.flops + p.cost.input_backward.flops + p.cost.weight_backward.flops
                    for p in compiled.programs)
        self.assertEqual(total, ours + attention)

    def test_graph_listings(self):
        block = _block_pipeline(hidden=8, seq=4, heads=2)
        self.assertExpectedInline(
            _listing(block.forward),
            """\
inputs: param:1.ln1.weight, param:1.ln1.bias, param:1.attn.qkv.weight, param:1.attn.qkv.bias, param:1.attn.proj.weight, param:1.attn.proj.bias, param:1.ln2.weight, param:1.ln2.bias, param:1.mlp.fc.weight, param:1.mlp.fc.bias, param:1.mlp.proj.weight, param:1.mlp.proj.bias, in:view_1
native_layer_norm = native_layer_norm.default(view_1_input, [8], _1_ln1_weight, _1_ln1_bias, 1e-05)
getitem = getitem(native_layer_norm, 0)
getitem_1 = getitem(native_layer_norm, 1)
getitem_2 = getitem(native_layer_norm, 2)
t = t.default(_1_attn_qkv_weight)
view = view.default(getitem, [8, 8])
addmm = addmm.default(_1_attn_qkv_bias, view, t)
view_1 = view.default(addmm, [2, 4, 24])
view_2 = view.default(view_1, [2, 4, -1, 12])
transpose = transpose.int(view_2, 1, 2)
split = split.Tensor(transpose, 4, -1)
getitem_3 = getitem(split, 0)
getitem_4 = getitem(split, 1)
getitem_5 = getitem(split, 2)
_scaled_dot_product_flash_attention_for_cpu = _scaled_dot_product_flash_attention_for_cpu.default(getitem_3, getitem_4, getitem_5, 0.0, True)
getitem_6 = getitem(_scaled_dot_product_flash_attention_for_cpu, 0)
getitem_7 = getitem(_scaled_dot_product_flash_attention_for_cpu, 1)
transpose_1 = transpose.int(getitem_6, 1, 2)
view_3 = view.default(transpose_1, [2, 4, -1])
t_1 = t.default(_1_attn_proj_weight)
view_4 = view.default(view_3, [8, 8])
addmm_1 = addmm.default(_1_attn_proj_bias, view_4, t_1)
view_5 = view.default(addmm_1, [2, 4, 8])
add = add.Tensor(view_1_input, view_5)
native_layer_norm_1 = native_layer_norm.default(add, [8], _1_ln2_weight, _1_ln2_bias, 1e-05)
getitem_8 = getitem(native_layer_norm_1, 0)
getitem_9 = getitem(native_layer_norm_1, 1)
getitem_10 = getitem(native_layer_norm_1, 2)
t_2 = t.default(_1_mlp_fc_weight)
view_6 = view.default(getitem_8, [8, 8])
addmm_2 = addmm.default(_1_mlp_fc_bias, view_6, t_2)
view_7 = view.default(addmm_2, [2, 4, 32])
gelu = gelu.default(view_7)
t_3 = t.default(_1_mlp_proj_weight)
view_8 = view.default(gelu, [8, 32])
addmm_3 = addmm.default(_1_mlp_proj_bias, view_8, t_3)
view_9 = view.default(addmm_3, [2, 4, 8])
add_1 = add.Tensor(add, view_9)
outputs: out:add_1, saved:getitem_1, saved:getitem_2, saved:view, saved:getitem_3, saved:getitem_4, saved:getitem_5, saved:getitem_6, saved:getitem_7, saved:view_4, saved:add, saved:getitem_9, saved:getitem_10, saved:view_6, saved:view_7, saved:view_8""",
        )
        self.assertExpectedInline(
            _listing(block.input_backward),
            """\
inputs: param:1.ln1.weight, param:1.ln1.bias, param:1.attn.qkv.weight, param:1.attn.proj.weight, param:1.ln2.weight, param:1.ln2.bias, param:1.mlp.fc.weight, param:1.mlp.proj.weight, in:view_1, tangent:add_1, saved:getitem_1, saved:getitem_2, saved:getitem_3, saved:getitem_4, saved:getitem_5, saved:getitem_6, saved:getitem_7, saved:add, saved:getitem_9, saved:getitem_10, saved:view_7
t = t.default(_1_attn_qkv_weight)
detach = detach.default(saved_getitem_6)
t_1 = t.default(_1_attn_proj_weight)
t_2 = t.default(_1_mlp_fc_weight)
t_3 = t.default(_1_mlp_proj_weight)
view_10 = view.default(tangent_add_1, [8, 8])
t_4 = t.default(t_3)
mm = mm.default(view_10, t_4)
view_12 = view.default(mm, [2, 4, 32])
gelu_backward = gelu_backward.default(view_12, saved_view_7)
view_13 = view.default(gelu_backward, [8, 32])
t_8 = t.default(t_2)
mm_2 = mm.default(view_13, t_8)
view_15 = view.default(mm_2, [2, 4, 8])
native_layer_norm_backward = native_layer_norm_backward.default(view_15, saved_add, [8], saved_getitem_9, saved_getitem_10, _1_ln2_weight, _1_ln2_bias, [True, False, False])
getitem_11 = getitem(native_layer_norm_backward, 0)
add_2 = add.Tensor(tangent_add_1, getitem_11)
view_16 = view.default(add_2, [8, 8])
t_12 = t.default(t_1)
mm_4 = mm.default(view_16, t_12)
view_18 = view.default(mm_4, [2, 4, 8])
view_19 = view.default(view_18, [2, 4, 2, 4])
transpose_2 = transpose.int(view_19, 1, 2)
detach_1 = detach.default(detach)
_scaled_dot_product_flash_attention_for_cpu_backward = _scaled_dot_product_flash_attention_for_cpu_backward.default(transpose_2, saved_getitem_3, saved_getitem_4, saved_getitem_5, detach_1, saved_getitem_7, 0.0, True)
getitem_14 = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 0)
getitem_15 = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 1)
getitem_16 = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 2)
cat = cat.default([getitem_14, getitem_15, getitem_16], 3)
transpose_3 = transpose.int(cat, 1, 2)
clone = clone.default(transpose_3)
_unsafe_view = _unsafe_view.default(clone, [2, 4, 24])
view_20 = view.default(_unsafe_view, [8, 24])
t_16 = t.default(t)
mm_6 = mm.default(view_20, t_16)
view_22 = view.default(mm_6, [2, 4, 8])
native_layer_norm_backward_1 = native_layer_norm_backward.default(view_22, view_1, [8], saved_getitem_1, saved_getitem_2, _1_ln1_weight, _1_ln1_bias, [True, False, False])
getitem_17 = getitem(native_layer_norm_backward_1, 0)
add_3 = add.Tensor(add_2, getitem_17)
outputs: grad:view_1, stash:view_10, stash:view_13, stash:view_15, stash:view_16, stash:view_20, stash:view_22""",
        )
        self.assertExpectedInline(
            _listing(block.weight_backward),
            """\
inputs: param:1.ln1.weight, param:1.ln1.bias, param:1.ln2.weight, param:1.ln2.bias, in:view_1, saved:getitem_1, saved:getitem_2, saved:view, saved:view_4, saved:add, saved:getitem_9, saved:getitem_10, saved:view_6, saved:view_8, stash:view_10, stash:view_13, stash:view_15, stash:view_16, stash:view_20, stash:view_22
t_5 = t.default(stash_view_10)
mm_1 = mm.default(t_5, saved_view_8)
t_6 = t.default(mm_1)
sum_1 = sum.dim_IntList(stash_view_10, [0], True)
view_11 = view.default(sum_1, [8])
t_7 = t.default(t_6)
t_9 = t.default(stash_view_13)
mm_3 = mm.default(t_9, saved_view_6)
t_10 = t.default(mm_3)
sum_2 = sum.dim_IntList(stash_view_13, [0], True)
view_14 = view.default(sum_2, [32])
t_11 = t.default(t_10)
native_layer_norm_backward_default = native_layer_norm_backward.default(stash_view_15, saved_add, [8], saved_getitem_9, saved_getitem_10, _1_ln2_weight, _1_ln2_bias, [False, True, True])
getitem_20 = getitem(native_layer_norm_backward_default, 2)
getitem = getitem(native_layer_norm_backward_default, 1)
t_13 = t.default(stash_view_16)
mm_5 = mm.default(t_13, saved_view_4)
t_14 = t.default(mm_5)
sum_3 = sum.dim_IntList(stash_view_16, [0], True)
view_17 = view.default(sum_3, [8])
t_15 = t.default(t_14)
t_17 = t.default(stash_view_20)
mm_7 = mm.default(t_17, saved_view)
t_18 = t.default(mm_7)
sum_4 = sum.dim_IntList(stash_view_20, [0], True)
view_21 = view.default(sum_4, [24])
t_19 = t.default(t_18)
native_layer_norm_backward_default_1 = native_layer_norm_backward.default(stash_view_22, view_1, [8], saved_getitem_1, saved_getitem_2, _1_ln1_weight, _1_ln1_bias, [False, True, True])
getitem_22 = getitem(native_layer_norm_backward_default_1, 2)
getitem_21 = getitem(native_layer_norm_backward_default_1, 1)
outputs: grad:param:1.ln1.weight, grad:param:1.ln1.bias, grad:param:1.attn.qkv.weight, grad:param:1.attn.qkv.bias, grad:param:1.attn.proj.weight, grad:param:1.attn.proj.bias, grad:param:1.ln2.weight, grad:param:1.ln2.bias, grad:param:1.mlp.fc.weight, grad:param:1.mlp.fc.bias, grad:param:1.mlp.proj.weight, grad:param:1.mlp.proj.bias""",
        )


def _listing(program) -> str:
    """One line per op: `name = target(args)`; placeholders by environment name."""
    lines = [f"inputs: {', '.join(program.signature.inputs)}"]
    for node in program.graph.graph.nodes:
        if node.op != "call_function":
            continue
        target = "getitem" if node.target is operator.getitem else str(node.target).removeprefix("aten.")
        args = ", ".join(str(a) for a in node.args)
        lines.append(f"{node.name} = {target}({args})")
    lines.append(f"outputs: {', '.join(program.signature.outputs)}")
    return "\n".join(lines)


class RandomDraws(TestCase):
    def test_a_random_draw_is_saved_for_the_backward_never_drawn_again(self):
        """`x * torch.rand(...)`: the backward needs the draw; it must be the forward's (saved),
        not a fresh one (recomputed like a parameter view would be)."""

        class Noisy(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(4, 8)
                self.b = nn.Linear(8, 2)

            def forward(self, x):
                return self.b(self.a(x) * torch.rand(x.shape[0], 8))

        x, target = torch.randn(6, 4), torch.randn(6, 2)
        compiled = compile_pipeline(Noisy(), torch.nn.functional.mse_loss, (x,), {}, target, 1)
        program = compiled.programs[0]
        forward_draws = [n for n in program.joint.forward.graph.graph.nodes if n.target is aten.rand.default]
        self.assertEqual(len(forward_draws), 1)
        for graph in (program.joint.backward, program.input_backward, program.weight_backward):
            self.assertFalse(
                [n for n in graph.graph.graph.nodes if n.target is aten.rand.default],
                f"{type(graph.graph).__name__} draws again",
            )
