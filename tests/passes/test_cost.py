"""Costs symbolic in the microbatch size."""

from __future__ import annotations

import sympy
import torch

from zbcompile.compiler import MICROBATCH, compile_pipeline, symbolic_stage_costs
from zbcompile.models.gpt import GPT, GPTConfig, lm_loss


def test_symbolic_costs_are_polynomials_that_match_every_compiled_size():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2))
    tokens = torch.randint(0, 64, (2, 16))
    compiled = compile_pipeline(model, lm_loss, (tokens,), {}, tokens, stages=2)
    formulas = symbolic_stage_costs(model, lm_loss, (tokens,), {}, tokens, compiled)
    assert len(formulas) == 2
    # at the compiled size the formulas give the compiled costs
    for formula, program in zip(formulas, compiled.programs):
        at = {MICROBATCH: 2}
        assert formula.forward_flops.subs(at) == program.cost.forward.flops
        assert formula.weight_backward_flops.subs(at) == program.cost.weight_backward.flops
        assert formula.mem_b.subs(at) == program.cost.mem_b
    # a size none of the fits used: compile it with the same cut and compare
    five = compile_pipeline(model, lm_loss, (tokens.repeat(5, 1)[:10],), {}, tokens.repeat(5, 1)[:10], 2, cuts=compiled.partition.cuts)
    for formula, program in zip(formulas, five.programs):
        at = {MICROBATCH: 10}
        assert formula.forward_flops.subs(at) == program.cost.forward.flops
        assert formula.input_backward_flops.subs(at) == program.cost.input_backward.flops
        assert formula.mem_w.subs(at) == program.cost.mem_w
    # matmuls and attention are linear in the batch
    for formula in formulas:
        assert sympy.degree(formula.forward_flops, MICROBATCH) == 1
