"""What each rank runs in the tensor-parallel tests (importable by spawned processes): pipelines
over a ("dp", "pp", "tp") DeviceMesh (or a subset) with torch's ParallelStyle plans, the zoo GPT
and a transformers Llama, 3 AdamW steps per schedule; parameter bytes per rank; a DCP
checkpoint saved at tp=2 and loaded at tp=1, at another pp and back; bad layouts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import zbcompile
import zbcompile.checkpoint
from helpers import models, real_models, recut_workers
from helpers.data_parallel_workers import local_bytes, whole
from helpers.distributed_workers import eager_adamw, make_optimizer
from zbcompile.inspect.write import live_dump
from zbcompile.models.gpt import GPT
from zbcompile.runtime.parallel.layout import from_first_rank, make_layout
from zbcompile.runtime.state.optimizer import SynchronousClipOptimizer

STEPS = 3
MICROBATCHES = 4
# (schedule, stages): a V over 4 stages, then three in-line schedules sharing one compile of 2
SCHEDULES = (("zbv", 4), ("1f1b", 2), ("zb-h1", 2), ("zb-auto", 2))


def gpt_plan() -> dict:
    """The zoo GPT's blocks, Megatron-LM's way: q/k/v and the MLP's first layer column-wise, the
    projections after them row-wise (embeddings, norms and the tied head replicated)."""
    return {
        "blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel(),
    }


def llama_plan(embeddings: bool = False) -> dict:
    """torchtitan's plan on transformers' names: q/k/v, gate and up column-wise, o and down
    row-wise; with `embeddings` the vocabulary split too (embedding row-wise, head column-wise)."""
    plan = {f"model.layers.*.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"model.layers.*.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    if embeddings:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def sequence_parallel_plan() -> dict:
    """An untied GPT with sequence parallelism (torchtitan's): norms on sequence shards, each
    attention and MLP gathering the sequence and their last layer reduce-scattering it."""
    def gathered(source, wanted):
        return PrepareModuleInput(input_layouts=source, desired_input_layouts=wanted, use_local_output=True)

    plan = {"blocks.0": gathered(Replicate(), Shard(1))}
    for block in ("blocks.0", "blocks.1"):
        plan.update({
            f"{block}.ln1": SequenceParallel(), f"{block}.ln2": SequenceParallel(),
            f"{block}.attn": gathered(Shard(1), Replicate()), f"{block}.mlp": gathered(Shard(1), Replicate()),
            f"{block}.attn.qkv": ColwiseParallel(), f"{block}.mlp.fc": ColwiseParallel(),
            f"{block}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{block}.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    plan["ln_f"] = SequenceParallel()
    plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def build(name: str):
    """The case `name`: "gpt" (the zoo's), "llama" (transformers'), "sp-gpt" (the zoo GPT untied),
    "meta-gpt" (the zoo GPT built on the meta device)."""
    if name == "llama":
        return real_models.build("llama")
    case = models.build("gpt")
    if name == "sp-gpt":
        torch.manual_seed(0)
        case = dataclasses.replace(case, model=GPT(dataclasses.replace(models.GPT_CONFIG, tie_embeddings=False)))
    if name == "meta-gpt":
        with torch.device("meta"):
            case = dataclasses.replace(case, model=GPT(models.GPT_CONFIG))
    return case


PLANS = {"gpt": gpt_plan, "llama": llama_plan, "sp-gpt": sequence_parallel_plan, "meta-gpt": lambda: None}
INITIAL = {"meta-gpt": "gpt"}  # the case whose parameters a case starts from, where not its own


def initial_state(name: str) -> dict:
    return build(INITIAL.get(name, name)).model.state_dict()


def mesh_of(sizes: dict[str, int]):
    """A DeviceMesh over the world with these dimensions (in ("dp", "pp", "tp") order)."""
    return init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))


def replica_case(name: str, mesh):
    """Case `name` with this replica's share of the batch."""
    case = build(name)
    if "dp" in mesh.mesh_dim_names:
        replicas, replica = mesh["dp"].size(), mesh.get_local_rank("dp")
        case.args = tuple(models.share(a, replicas, replica) for a in case.args)
        case.kwargs = {k: models.share(v, replicas, replica) for k, v in case.kwargs.items()}
        case.target = models.share(case.target, replicas, replica)
    return case


QUICK = {"solver_time_budget": 0.2, "profile": False}  # no measured decisions: one compile serves all schedules


def pipe_of(name: str, mesh, stages: int, schedule: str, **options):
    """A pipeline of case `name` over `mesh` with its plan given as `tensor_parallel=` (`QUICK`
    unless `options` say otherwise); the meta GPT's applied by `parallelize_module` on
    `mesh["tp"]` first, as a user applies it."""
    case = replica_case(name, mesh)
    if name == "meta-gpt":
        parallelize_module(case.model, mesh["tp"], gpt_plan())
    options = {"tensor_parallel": PLANS[name](), **QUICK, **options}
    pipe = zbcompile.pipeline(
        case.model, stages=stages, microbatches=MICROBATCHES, loss_fn=case.loss_fn, schedule=schedule,
        process_group=mesh, timeout=120, **options,
    )
    pipe.compile(*case.args, target=case.target, **case.kwargs)
    return case, pipe


DEFAULTS = {"solver_time_budget": None, "profile": None}  # zbcompile.pipeline's own


def train(
    name: str, sizes: dict[str, int], data_parallel: str = "replicate", schedules=SCHEDULES, dump=None,
    clipped: bool = False, successive: bool = False, forced_recut: bool = False,
) -> dict:
    """`STEPS` AdamW steps of case `name` per schedule from the same initial parameters; per
    schedule the losses, the first step's whole gradients, the whole parameters after the steps
    (by FQN, this rank's) and the cut; the last compile dumps into `dump`. Schedules of one
    number of stages share a `QUICK` compile, or with `successive` each is a pipeline of its
    own with the default options (zb-auto measures, may re-cut and re-solves), built after the
    one before, as a user tries schedules in one process; with `forced_recut` zb-auto's cut
    decision is made to re-cut (`recut_workers.forced`: its state moves between ranks, as
    DTensor shards over "tp", and back where the race keeps the compiler's cut). With `clipped`, then 2 zb-h1 steps of
    AdamW behind `SynchronousClipOptimizer` (max_norm 0.05: every step clipped), whose norm must
    sum the shards over "tp" (and "dp") once each: the whole parameters after them."""
    mesh, results = mesh_of(sizes), {}
    initial = initial_state(name)
    pipe, compiled_stages = None, None
    for schedule, stages in schedules:
        if stages != compiled_stages or successive:
            extra = {"dump_dir": dump} if dump is not None and stages == schedules[-1][1] else {}
            extra.update(DEFAULTS if successive else {})
            forcing = forced_recut and schedule == "zb-auto"
            recutting = recut_workers.forced("flip") if forcing else contextlib.nullcontext()
            with recutting:
                case, pipe = pipe_of(name, mesh, stages, schedule, data_parallel=data_parallel, **extra)
            compiled_stages = stages
        else:
            pipe.set_schedule(schedule)
        pipe.load_state_dict(initial, strict=False)
        optimizer = make_optimizer("adamw", pipe.parameters())
        losses, grads = [], None
        for _ in range(STEPS):
            optimizer.zero_grad()
            losses.append(case.step(pipe))
            grads = grads or {n: whole(p.grad) for n, p in pipe.named_parameters()}
            optimizer.step()
        results[schedule] = {
            "losses": losses, "grads": grads, "params": {n: whole(p) for n, p in pipe.named_parameters()},
            "dtensor": {n: isinstance(p, DTensor) for n, p in pipe.named_parameters()},
            "bytes": {
                "params": local_bytes(pipe.parameters()),
                "grads": local_bytes(p.grad for p in pipe.parameters() if p.grad is not None),
                "optimizer": local_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim()),
            },
            "state_rows": live_dump(pipe).record["world"]["state_bytes"][pipe.runner.layout.pp_rank],
            "cut": tuple(pipe.runner.compiled.partition.cuts),
        }
    if clipped:
        pipe.set_schedule("zb-h1")
        pipe.load_state_dict(initial, strict=False)
        optimizer = SynchronousClipOptimizer(make_optimizer("adamw", pipe.parameters()), pipe, max_norm=0.05)
        for _ in range(2):
            optimizer.zero_grad()
            case.step(pipe)
            optimizer.step()
        results["clipped"] = {n: whole(p) for n, p in pipe.named_parameters()}
    return results


def parameter_bytes() -> dict:
    """This rank's pipeline position, bytes of parameters and first step's loss (None off the last
    stage), for the Llama with the vocabulary split too, cut at the same place at tp=2 (a
    ("pp", "tp") mesh) and tp=1 (("dp", "pp"))."""
    result = {}
    layouts = (("tp2", {"pp": 2, "tp": 2}, llama_plan(embeddings=True)), ("tp1", {"dp": 2, "pp": 2}, None))
    for label, sizes, plan in layouts:
        mesh = mesh_of(sizes)
        case, pipe = pipe_of(
            "llama", mesh, 2, "zb-h1", tensor_parallel=plan, split_points=["model.layers.1"],
        )
        result[label] = (mesh.get_local_rank("pp"), local_bytes(pipe.parameters()), case.step(pipe))
    return result


def checkpoint_across_degrees(directory: str) -> dict:
    """The GPT trained 2 steps at pp=2 x tp=2 and saved; loaded at tp=1 (pp=2 x dp=2), at pp=4
    (tp=1), saved again there and loaded back at tp=2: the whole parameters and AdamW state by
    FQN after each load, and those saved."""
    layouts = {
        "tp2": ({"pp": 2, "tp": 2}, 2, gpt_plan()), "tp1": ({"dp": 2, "pp": 2}, 2, None),
        "pp4": ({"pp": 4}, 4, None), "back": ({"pp": 2, "tp": 2}, 2, gpt_plan()),
    }
    results = {}

    def state(pipe, optimizer) -> dict:
        names = {p: n for n, p in pipe.named_parameters()}
        return {
            "params": {n: whole(p) for n, p in pipe.named_parameters()},
            "optimizer": {names[p]: {k: whole(v) for k, v in s.items()} for p, s in optimizer.state.items()},
        }

    for label, (sizes, stages, plan) in layouts.items():
        case, pipe = pipe_of("gpt", mesh_of(sizes), stages, "zb-h1", tensor_parallel=plan)
        optimizer = make_optimizer("adamw", pipe.parameters())
        if label == "tp2":
            pipe.load_state_dict(build("gpt").model.state_dict(), strict=False)
            for _ in range(2):
                optimizer.zero_grad()
                case.step(pipe)
                optimizer.step()
            zbcompile.checkpoint.save(os.path.join(directory, "tp2"), pipe, optimizer)
            results["saved"] = state(pipe, optimizer)
            continue
        source = "pp4" if label == "back" else "tp2"
        zbcompile.checkpoint.load(os.path.join(directory, source), pipe, optimizer)
        results[label] = state(pipe, optimizer)
        if label == "pp4":
            zbcompile.checkpoint.save(os.path.join(directory, "pp4"), pipe, optimizer)
    return results


class _Heads(nn.Module):
    """A model whose attention-like block has 3 heads (the tp degree 2 does not divide them)."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 3
        self.qkv = nn.Linear(6, 18)
        self.out = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.qkv(x)[..., :6])


def errors() -> dict:
    """Bad layouts on 4 ranks, each refused on every rank: the message of each ValueError."""
    pp_tp = {"pp": 2, "tp": 2}
    linears = lambda: nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))  # noqa: E731

    def parallelized_already() -> nn.Module:
        model = GPT(models.GPT_CONFIG)
        return parallelize_module(model, mesh_of(pp_tp)["tp"], gpt_plan())

    cases = {  # label: (the model, tensor_parallel=, the mesh's sizes, stages)
        "missing module": (lambda: GPT(models.GPT_CONFIG), {"blocks.*.attn.q_proj": ColwiseParallel()}, pp_tp, 2),
        "heads": (_Heads, {"qkv": ColwiseParallel(), "out": RowwiseParallel()}, pp_tp, 2),
        "hidden": (lambda: nn.Sequential(nn.Linear(6, 3), nn.Linear(3, 6)), {"0": ColwiseParallel()}, pp_tp, 2),
        "no tp module": (linears, None, pp_tp, 2),
        "pp size": (linears, None, {"dp": 2, "pp": 2}, 4),
        "order": (linears, None, {"tp": 2, "pp": 2}, 2),
        "applied twice": (parallelized_already, gpt_plan(), pp_tp, 2),
        # a head whose output stays a DTensor (loss_parallel's layout), read by the loss function
        "dtensor read outside": (linears, {"1": ColwiseParallel(use_local_output=False)}, pp_tp, 2),
    }
    messages = {}
    for label, (make, plan, sizes, stages) in cases.items():
        torch.manual_seed(0)
        model = make()
        x, target = (torch.randint(0, 64, (4, 8)),) * 2 if isinstance(model, GPT) else (torch.randn(4, 6),) * 2
        try:
            pipe = zbcompile.pipeline(
                model, stages=stages, microbatches=2, loss_fn=models.lm_loss if isinstance(model, GPT) else F.mse_loss,
                process_group=mesh_of(sizes), tensor_parallel=plan, timeout=30,
            )
            pipe.compile(x, target=target)
            messages[label] = None
        except ValueError as error:
            messages[label] = str(error)
    dist.barrier()
    return messages


# the Llama's successive pipelines at four ranks: 1f1b, then zb-auto (every schedule's Llama, the V
# included, at eight ranks)
SUCCESSIVE = (("1f1b", 2), ("zb-auto", 2))


def four_ranks(directory: str) -> dict:
    """Everything the four-rank launch checks of tensor parallelism, in order (the Llama in
    successive pipelines with the default options, zb-auto's re-cut forced)."""
    return {
        "gpt": train("gpt", {"pp": 2, "tp": 2}, dump=os.path.join(directory, "dump"), clipped=True),
        "llama": train("llama", {"pp": 2, "tp": 2}, schedules=SUCCESSIVE, successive=True, forced_recut=True),
        "sp-gpt": train("sp-gpt", {"pp": 2, "tp": 2}, schedules=(("zb-h1", 2),)),
        "meta-gpt": train("meta-gpt", {"pp": 2, "tp": 2}, schedules=(("zb-h1", 2),)),
        "bytes": parameter_bytes(),
        "checkpoint": checkpoint_across_degrees(os.path.join(directory, "dcp")),
        "errors": errors(),
    }


def decided_everywhere(sizes: dict[str, int]) -> tuple[bool, int]:
    """Whether this rank decides, and the deciding rank's value on this rank (each rank offers
    its global rank) on a mesh of `sizes`."""
    layout = make_layout(sizes["pp"], torch.device("cpu"), "a test's pipeline", mesh_of(sizes))
    return layout.decides, from_first_rank(dist.get_rank(), layout)


def eight_ranks() -> dict:
    """dp=2 x pp=2 x tp=2: one decision for every rank; the GPT with data_parallel="shard", the
    Llama with "replicate" (successive default pipelines on this mesh: benchmarks/successive_pipelines.py
    --eight, eight processes on two cores being the suite's dearest launch)."""
    return {
        "decided": decided_everywhere({"dp": 2, "pp": 2, "tp": 2}),
        "gpt": train("gpt", {"dp": 2, "pp": 2, "tp": 2}, data_parallel="shard", clipped=True),
        "llama": train("llama", {"dp": 2, "pp": 2, "tp": 2}),
    }


# --- comparison with eager --------------------------------------------------------------------

CLOSE = dict(rtol=1e-5, atol=1e-6)
# parameters after the AdamW steps: a sequence-parallel embedding's gradient is summed over "tp" in
# another order than eager's, and Adam's normalised update turns that rounding into up to 1.4e-6 on
# some CPUs' kernels (sp-gpt's tok_emb, the same at 6f882b2); a wrong gradient moves a parameter by
# about the learning rate, 1e-2
PARAMS_CLOSE = dict(rtol=1e-5, atol=5e-6)


@functools.cache
def eager(name: str) -> tuple[torch.Tensor, dict]:
    """The first step's loss and the parameters after `STEPS` eager AdamW steps over the whole batch."""
    case = build(INITIAL.get(name, name))
    losses, _ = eager_adamw(case, STEPS)
    return losses[0], {n: p.detach() for n, p in case.model.named_parameters()}


def merged(per_rank: list[dict], name: str, schedule: str, field: str) -> dict:
    """`field` of every rank's run merged by FQN, checking that every rank holding an entry holds
    the same bits (the tensor-parallel ranks of a stage, the replicas)."""
    result: dict = {}
    for rank in per_rank:
        for fqn, value in rank[name][schedule][field].items():
            if fqn in result:
                assert torch.equal(result[fqn], value), f"{name} {schedule}: ranks differ on {field} {fqn}"
            result[fqn] = value
    return result


def check_equals_eager(per_rank: list[dict], names: tuple[str, ...]) -> None:
    """Every schedule's first loss and parameters after the steps (`train`'s, every rank's) equal eager's."""
    for name in names:
        loss, params = eager(name)
        for schedule in [s for s in per_rank[0][name] if s != "clipped"]:
            losses = [r[name][schedule]["losses"] for r in per_rank if r[name][schedule]["losses"][0] is not None]
            assert losses, (name, schedule)
            torch.testing.assert_close(sum(ls[0] for ls in losses) / len(losses), loss, **CLOSE)
            whole_params = merged(per_rank, name, schedule, "params")
            assert whole_params.keys() == params.keys(), (name, schedule)
            for fqn, value in params.items():
                torch.testing.assert_close(whole_params[fqn], value, **PARAMS_CLOSE, msg=f"{name} {schedule} {fqn}")
