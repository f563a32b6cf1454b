"""Which schedule a compile runs, and where its stages sit: zb-auto's choice between one stage
per rank and a V of two chunks per rank (`placed`), the schedule solved on the pipeline's first
rank and broadcast, recompute="auto"'s levels, and the tuner that re-solves with measured costs.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable

import torch

from zbcompile.compiler import CompiledPipeline
from zbcompile.options import PipelineOptions
from zbcompile.passes.graph_cost import FLOPS_PER_BYTE
from zbcompile.runtime.parallel import grad_reduction
from zbcompile.runtime.parallel.layout import Layout, from_first_rank
from zbcompile.runtime.step.stage_compiler import compile_stage_programs
from zbcompile.runtime.tuning import auto_recompute, profile
from zbcompile.schedules import Costs, Schedule, make_schedule, schedule_spec
from zbcompile.schedules.costs import ResolvedCosts, resolve_costs, with_reduction
from zbcompile.schedules.memory_limit import (
    DEFAULT_LIMIT_RULE,
    default_limit,
    in_schedule_units,
    is_bytes,
    limit_in_words,
)
from zbcompile.schedules.v_choice import PLACEMENTS

CompileIn = Callable[[int, "int | None"], CompiledPipeline]  # (stages, memory_unit_bytes) -> the model compiled


class ScheduleChoice:
    """Chooses the schedules of a pipeline's compiles under `options` (replaced by `reschedule`);
    `layout()` is this rank's place among the pipelines, asked only in a distributed run."""

    def __init__(self, options: PipelineOptions, layout: Callable[[], Layout]) -> None:
        self.options = options
        self.layout = layout

    def placed(self, compiled: CompiledPipeline, compile_in: CompileIn) -> tuple[CompiledPipeline, Schedule]:
        """`compiled` (one stage per rank) and its schedule; or, where zb-auto predicts a V of two
        chunks per rank faster by its objective with each chunk estimated as half a stage (or the
        V alone fits the memory limit), the model compiled again in twice the stages, its memory
        still counted in the first compile's unit, with the V solved on the chunks' own costs, if
        it is still faster than one stage per rank. recompute="auto" and split points keep one
        stage per rank; so does a model that does not cut into twice the stages. `compile_in(stages,
        memory_unit_bytes)` compiles the model again."""
        o = self.options
        offer_v = o.recompute != "auto" and o.split_points is None
        schedule = self.schedule(compiled, PLACEMENTS if offer_v else ("in-line",))
        if schedule.stages == len(compiled.programs):
            return compiled, schedule
        in_line_value = schedule.info.get("in_line_value")  # None: no schedule of one stage per rank fits
        try:
            chunks = compile_in(schedule.stages, compiled.memory_unit())
            v_schedule = self.schedule(chunks)
        except ValueError as error:
            if in_line_value is not None:  # the model does not cut into 2p chunks, or they do not fit
                return compiled, self.schedule(compiled)
            raise ValueError(
                f"zb-auto chose a V of {schedule.stages} chunks under memory_limit {o.memory_limit!r} with each chunk "
                f"estimated as half a stage, but the chunks as compiled do not fit it ({error}); raise the limit"
            ) from error
        if in_line_value is not None and v_schedule.info["value"] >= in_line_value:
            return compiled, self.schedule(compiled).with_info(v_value=v_schedule.info["value"])
        return chunks, v_schedule.with_info(in_line_value=in_line_value)

    def schedule(
        self, compiled: CompiledPipeline, placements: tuple[str, ...] = ("in-line",), costs: Costs | None = None
    ) -> Schedule:
        """The schedule, solved on one rank and broadcast so that every rank runs the same one;
        zb-auto may choose among `placements` (`v_choice.PLACEMENTS`). `costs`: per compiled stage,
        measured or predicted from measurements (`runtime/tuning/recut.py`), in place of the compiler's."""

        def solve() -> Schedule:
            given = self.options.costs
            try:
                if costs is not None:
                    solved_with = costs
                elif given is None:
                    solved_with = static_costs(compiled)
                else:
                    solved_with = self._per_compiled_stage(given, compiled)
                arguments = self.solve_arguments(solved_with, compiled, placements)
                schedule = make_schedule(**arguments)
            except ValueError as error:
                if not is_bytes(self.options.memory_limit):
                    raise
                raise ValueError(
                    f"{limit_in_words(self.options.memory_limit, compiled.memory_unit())}: {error}"
                ) from error
            limit = arguments["memory_limit"]
            # the costs as solve_arguments counts them
            made_with = with_reduction(solved_with, self.reduction_per_message(compiled))
            reduction = made_with.reduce
            info: dict[str, Any] = (
                {"cost_source": "measured", "costs": made_with} if costs is not None
                else {"cost_source": "given", "costs": given} if given is not None else {"cost_source": "static"}
            )
            if not isinstance(reduction, (int, float)) and any(reduction):
                info["reduction"] = tuple(reduction)
            if limit is not None:
                rule = "given" if self.options.memory_limit is not None else DEFAULT_LIMIT_RULE
                info.update(memory_limit=limit, memory_limit_rule=rule)
            return schedule.with_info(**info)

        return self._on_first_rank(solve)

    def fit_memory_by_recomputing(self, compiled: CompiledPipeline) -> CompiledPipeline:
        """recompute="auto": `compiled` at the recompute levels under which the schedule fits the
        memory limit in the least time (`auto_recompute`), chosen on one rank and broadcast
        (zb-auto's solver may differ per rank). A limit in bytes is read in `compiled`'s memory
        unit, the largest stage's M_B before recomputation, which the chosen levels keep."""

        def choose() -> tuple[int, ...]:
            evaluate = functools.partial(auto_recompute.evaluate_memory, solve_arguments=self.solve_arguments)
            return auto_recompute.choose_recomputation(compiled, evaluate).recompute_levels

        return auto_recompute.with_levels(compiled, self._on_first_rank(choose))

    def _on_first_rank(self, make: Callable[[], Any]) -> Any:
        """`make()` on the deciding rank (in one process: here), broadcast to every other rank
        (`layout.from_first_rank`)."""
        layout = self.layout() if self.options.distributed else None
        value = make() if layout is None or layout.decides else None
        return from_first_rank(value, layout)

    def solve_arguments(
        self, costs: Costs, compiled: CompiledPipeline, placements: tuple[str, ...] = ("in-line",)
    ) -> dict[str, Any]:
        """`make_schedule`'s arguments for this pipeline's schedule under `costs` (a limit in bytes
        in `compiled`'s memory unit; `costs` per compiled stage). A compile in twice the
        schedule's stages is zb-auto's V: the schedule is solved in the V again, on its chunks'
        costs. Without a limit, `memory_limit.default_limit`'s rule on the costs solved with."""
        o = self.options
        limit = in_schedule_units(o.memory_limit, compiled.memory_unit())
        costs = with_reduction(costs, self.reduction_per_message(compiled))
        arguments = dict(
            name=o.schedule, stages=o.stages, microbatches=o.microbatches, costs=costs, memory_limit=limit,
            time_budget=o.solver_time_budget, objective=o.objective, placements=placements,
        )
        if isinstance(o.schedule, Schedule):  # run as given: checked against the compiled stages
            arguments["stages"] = len(compiled.programs)
        elif "v" in placements and o.costs is None:  # on the compiler's costs, zb-auto weighs the V by time
            arguments["v_always"] = True
        if self._is_v_compile(compiled) and not isinstance(o.schedule, Schedule):
            chunks = resolve_costs(costs, len(compiled.programs))
            arguments.update(costs=chunks.merged(2), chunk_costs=chunks, placements=("v",))
        if limit is None:
            arguments["memory_limit"] = default_limit(
                o.schedule, o.stages, o.microbatches, arguments["costs"], compiled.checkpointed()
            )
        return arguments

    def reduction_per_message(self, compiled: CompiledPipeline) -> tuple[float, ...]:
        """Per compiled stage, its gradient reduction over the replicas in boundary messages
        (`grad_reduction.reduction_per_message`): what the schedule counts after its last W."""
        o = self.options
        replicas = self.layout().dp_size if o.distributed else 1
        return grad_reduction.reduction_per_message(compiled, replicas, o.data_parallel, o.grad_dtype)

    def _is_v_compile(self, compiled: CompiledPipeline) -> bool:
        """Whether `compiled` is zb-auto's V: twice the stages the pipeline was given."""
        return len(compiled.programs) != self.options.stages

    def _per_compiled_stage(self, given: Costs, compiled: CompiledPipeline) -> Costs | ResolvedCosts:
        """`pipeline(costs=...)`, given per stage, for `compiled`'s stages: cut in two for a V."""
        return resolve_costs(given, self.options.stages).chunked(2) if self._is_v_compile(compiled) else given

    def tuner(self, compiled: CompiledPipeline, device: torch.device | None = None) -> profile.CostTuner | None:
        """Measured costs for a distributed pipeline whose programs run on `device`, where
        `profile` asks for them (None: where the schedule table says the schedule measures them,
        without given costs)."""
        wanted = self.options.profile
        if wanted is None:
            given = isinstance(self.options.schedule, Schedule)  # nothing to re-solve
            wanted = not given and schedule_spec(self.options.schedule).measures_costs and self.options.costs is None
        if not wanted or not self.options.distributed:
            return None
        solve_arguments = functools.partial(self.solve_arguments, compiled=compiled)
        recompute = None
        if self.options.recompute == "auto":
            finish = functools.partial(compile_stage_programs, compiler=self.options.compiler, device=device)
            recompute = auto_recompute.MeasuredRecomputation(compiled, self.solve_arguments, finish)
        reduction = self.reduction_per_message(compiled)
        return profile.CostTuner(
            self.options.profile_steps, solve_arguments, compiled.schedule_costs(), recompute, reduction,
            self.options.race_rounds,
        )


def static_costs(compiled: CompiledPipeline) -> Costs:
    """The compiler's estimates (`CompiledPipeline.schedule_costs`) with a message's time: the
    largest boundary's bytes, written once by the sender and once by the receiver, in the same
    FLOP-equivalents (`graph_cost.FLOPS_PER_BYTE`), so that the V's extra messages count."""
    costs = compiled.schedule_costs()
    largest = max(compiled.partition.boundary_bytes, default=0)
    return replace(costs, comm=2 * FLOPS_PER_BYTE * largest)
