"""Multi-process pipelines (gloo on CPU): every schedule gives the gradients of the unpipelined
model; optimizer steps, state dicts, data parallelism, meta-device models, failures."""

from __future__ import annotations

import pytest
import torch

import zbcompile
from helpers import distributed_workers as workers
from helpers import launches
from helpers.models import NAMES, batch_for, build
from helpers.multiprocess import Failed, run_ranks
from zbcompile.runtime.tuning.contest import MIN_ROUNDS
from zbcompile.schedules import Action, make_schedule, schedule_spec

SINGLE_CHUNK, TWO_CHUNK, MORE_TWO_CHUNK, MIRRORED, SMALLEST = (
    workers.SINGLE_CHUNK, workers.TWO_CHUNK, workers.MORE_TWO_CHUNK, workers.MIRRORED, workers.SMALLEST
)
TORCH_DUALPIPEV = workers.TORCH_DUALPIPEV


PARTIAL_RUNS, LATE_STEPS, PROFILED = launches.PARTIAL_RUNS, launches.LATE_STEPS, launches.PROFILED


def _battery(ranks: int) -> list[dict]:
    """Every rank's results of `workers.battery_runs(ranks)`, from the shared launch of `ranks` ranks."""
    return {2: launches.two_rank_results, 4: launches.four_rank_results}[ranks]("battery")


def _shared(label: str) -> list:
    """Every rank's result of the entry `label` of the shared two-rank launch (`launches.two_rank_calls`)."""
    return launches.two_rank_results(label)


@pytest.fixture(scope="module")
def profiled():
    """What each run of `PROFILED` returned, per rank."""
    per_rank = _shared("profiled")
    return {name: [r[i] for r in per_rank] for i, name in enumerate(PROFILED)}


@pytest.fixture(
    params=[
        pytest.param(2, id="2ranks", marks=launches.READS_TWO_RANKS),
        pytest.param(4, id="4ranks", marks=launches.READS_FOUR_RANKS),
    ]
)
def battery(request):
    """Every rank's results of `workers.battery_runs(ranks)`, computed once per session whatever the test order."""
    return request.param, _battery(request.param)


def _reference(name: str, microbatches: int = 4):
    case = build(name, batch=batch_for(microbatches))
    loss = case.eager_loss()
    loss.backward()
    return case, loss


def _merged(per_rank: list[dict], key: tuple, field: str) -> dict:
    merged = {}
    for result in per_rank:
        for k, v in result[key][field].items():
            assert k not in merged or field == "grads", f"{k} reported by two ranks"
            if k in merged:  # a tied weight's gradient, held by two ranks: the same sum on both
                assert torch.equal(merged[k], v), k
            merged[k] = v
    return merged


def test_gradients_equal_eager_for_every_model_and_schedule(battery):
    ranks, per_rank = battery
    for name in NAMES:
        for key in [k for k in per_rank[0] if k[0] == name]:
            case, loss = _reference(name, key[3])
            losses = [r[key]["loss"] for r in per_rank if r[key]["loss"] is not None]
            assert len(losses) == 1, f"{key}: the loss must be returned on exactly one rank"
            torch.testing.assert_close(losses[0], loss.detach(), rtol=1e-5, atol=1e-6, msg=f"{key} loss")
            grads = _merged(per_rank, key, "grads")
            expected = dict(case.model.named_parameters())
            assert grads.keys() == expected.keys(), key
            for fqn, grad in grads.items():
                torch.testing.assert_close(grad, expected[fqn].grad, rtol=1e-5, atol=1e-6, msg=f"{key} {fqn}")


def test_gradients_bitwise_equal_across_schedules(battery):
    """Every single-copy schedule sums microbatch gradients in microbatch order. A mirrored one
    (dualpipe) adds its two copies' sums, which differs by rounding only (the test above); its
    two copies of a parameter hold the same bits (`_merged`)."""
    ranks, per_rank = battery
    for name in NAMES:
        for stages, first_schedule in ((ranks, "1f1b"), (2 * ranks, "interleaved-1f1b")):
            keys = [
                k for k in per_rank[0]
                if k[0] == name and k[2] == stages and isinstance(k[1], str) and not schedule_spec(k[1]).mirrored
            ]
            grads = {k[1]: _merged(per_rank, k, "grads") for k in keys}
            first = grads[first_schedule]
            for schedule, other in grads.items():
                for fqn in first:
                    assert torch.equal(first[fqn], other[fqn]), (
                        f"{name}: {fqn} differs between {first_schedule} and {schedule}"
                    )


@launches.READS_FOUR_RANKS
def test_torch_dualpipev_csv_runs_on_four_ranks():
    """torch's own DualPipeV file, read with Schedule.from_csv and given to pipeline(): every rank
    runs its row's actions (an OVERLAP_F_B pair as its two actions), and loss and gradients equal
    eager's."""
    per_rank = _battery(TORCH_DUALPIPEV.ranks)
    key = (SMALLEST, TORCH_DUALPIPEV, TORCH_DUALPIPEV.stages, TORCH_DUALPIPEV.microbatches)
    for rank, result in enumerate(per_rank):
        assert sorted(a for a, _, _ in result[key]["timeline"]) == sorted(map(str, TORCH_DUALPIPEV.actions[rank]))
    case, loss = _reference(SMALLEST, TORCH_DUALPIPEV.microbatches)
    losses = [r[key]["loss"] for r in per_rank if r[key]["loss"] is not None]
    assert len(losses) == 1
    torch.testing.assert_close(losses[0], loss.detach(), rtol=1e-5, atol=1e-6)
    grads = _merged(per_rank, key, "grads")
    assert grads.keys() == dict(case.model.named_parameters()).keys()
    for fqn, param in case.model.named_parameters():
        torch.testing.assert_close(grads[fqn], param.grad, rtol=1e-5, atol=1e-6, msg=fqn)


def test_gathered_state_dict_loads_strictly(battery):
    ranks, per_rank = battery
    for name in NAMES:
        case = build(name)
        for key in [k for k in per_rank[0] if k[0] == name]:
            gathered = _merged(per_rank, key, "state")
            fresh = build(name).model
            fresh.load_state_dict(gathered, strict=True)
            for k, v in case.model.state_dict().items():
                assert torch.equal(gathered[k], v), f"{key}: {k}"


def test_each_rank_holds_only_its_parameters(battery):
    ranks, per_rank = battery
    key = ("gpt", "1f1b", ranks, 4)
    total = sum(p.numel() * p.element_size() for p in build("gpt").model.parameters())
    held = [r[key]["param_bytes"] for r in per_rank]
    assert all(0 < h < total for h in held), held
    # the tied embedding is held by the first and the last rank, nothing else is held twice
    embedding = build("gpt").model.tok_emb.weight
    assert sum(held) == total + embedding.numel() * embedding.element_size()


def test_held_state_dict_is_the_models_entries_each_rank_holds(battery):
    """held_state_dict() on each rank: entries of the model's own state dict, equal to them; every
    entry on some rank; the tied embedding, under each of its names, on the first and the last
    rank (both use it); every other entry on one rank."""
    ranks, per_rank = battery
    key = ("gpt", "1f1b", ranks, 4)
    expected = build("gpt").model.state_dict()
    held = [r[key]["held"] for r in per_rank]
    for rank, entries in enumerate(held):
        assert entries, f"rank {rank} holds nothing"
        for name, value in entries.items():
            assert torch.equal(value, expected[name]), f"rank {rank}: {name}"
    tied = {k for k, v in expected.items() if v.data_ptr() == expected["tok_emb.weight"].data_ptr()}
    assert len(tied) == 2, tied  # the embedding and the output layer
    for name in expected:
        holders = [rank for rank, entries in enumerate(held) if name in entries]
        assert holders == ([0, ranks - 1] if name in tied else holders[:1]) and holders, (name, holders)


def test_dualpipe_ranks_hold_both_their_stages(battery):
    """Rank r runs stage r of one copy and stage p-1-r of the other: it holds the parameters
    that 1F1B puts on ranks r and p-1-r, and every compute action runs once on its rank."""
    ranks, per_rank = battery
    single, mirrored = ((SMALLEST, s, ranks, 4) for s in ("1f1b", "dualpipe"))
    held = [r[single]["param_bytes"] for r in per_rank]
    assert [r[mirrored]["param_bytes"] for r in per_rank] == [held[r] + held[ranks - 1 - r] for r in range(ranks)]
    schedule = make_schedule("dualpipe", ranks, 4)
    for rank, result in enumerate(per_rank):
        ran = sorted(Action.parse(a) for a, _, _ in result[mirrored]["timeline"])
        assert ran == sorted(schedule.actions[rank])
        assert {(a.stage, a.microbatch) for a in ran if a.kind == "F"} == {
            (rank, 0),
            (rank, 1),
            (ranks - 1 - rank, 2),
            (ranks - 1 - rank, 3),
        }


def test_dualpipe_in_one_process_gives_the_bits_of_its_ranks(battery):
    """One process runs both copies of every stage and sums their gradients as the ranks holding
    them do: the same bits (single-threaded, as the ranks run), the tied embedding included."""
    ranks, per_rank = battery
    name = "gpt" if ranks == 2 else SMALLEST
    key = (name, "dualpipe", ranks, 4)
    case = build(name)
    pipe = zbcompile.pipeline(case.model, stages=ranks, microbatches=4, loss_fn=case.loss_fn, schedule="dualpipe")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loss = case.step(pipe)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(loss, next(r[key]["loss"] for r in per_rank if r[key]["loss"] is not None))
    grads = _merged(per_rank, key, "grads")
    for fqn, param in case.model.named_parameters():
        assert torch.equal(param.grad, grads[fqn]), fqn


def test_timeline_has_every_compute_action_once(battery):
    ranks, per_rank = battery
    key = ("gpt", "zb-h1", ranks, 4)
    actions = sorted(a for r in per_rank for a, _, _ in r[key]["timeline"])
    expected = sorted(f"{s}{k}{m}" for s in range(ranks) for k in "FIW" for m in range(4))
    assert actions == expected
    for r in per_rank:
        assert all(end >= start for _, start, end in r[key]["timeline"])


@launches.READS_TWO_RANKS
def test_three_optimizer_steps_match_eager():
    """SGD with momentum and AdamW: three steps each, every parameter equal to eager's; under
    dualpipe both ranks' copies of every parameter stay the same bits."""
    name, schedules, _, _, steps = launches.TRAIN
    per_rank = _shared("train")
    for optimizer in ("sgd", "adamw"):
        reference = build(name)
        opt = workers.make_optimizer(optimizer, reference.model.parameters())
        for _ in range(steps):
            opt.zero_grad()
            reference.eager_loss().backward()
            opt.step()
        for schedule in schedules:
            run = (schedule, optimizer)
            gathered = {k: v for r in per_rank for k, v in r[run]["state"].items()}
            for k, v in reference.model.state_dict().items():
                torch.testing.assert_close(gathered[k], v, rtol=1e-5, atol=1e-6, msg=f"{run}: {k}")
        copies = [r[("dualpipe", optimizer)]["params"] for r in per_rank]
        assert copies[0].keys() == copies[1].keys() == dict(reference.model.named_parameters()).keys()
        for fqn, value in copies[0].items():
            assert torch.equal(value, copies[1][fqn]), f"dualpipe {optimizer}: {fqn}"


@launches.READS_FOUR_RANKS
def test_two_data_parallel_replicas_of_a_two_stage_pipeline():
    """zb-h1, and dualpipe (each replica's two copies summed, then the replicas averaged); a
    (loss_sum, count) loss over targets padded so that the replicas hold different numbers of
    tokens: both replicas return the whole batch's loss, and the averaged gradient is eager
    full-batch training's (the count is summed over the replicas)."""
    per_rank = launches.four_rank_results("replicas")
    for key in workers.REPLICA_RUNS:
        case, loss = _reference(key[0])
        losses = [r[key]["loss"] for r in per_rank if r[key]["loss"] is not None]
        assert len(losses) == 2, key  # one per replica, each its half of the batch
        torch.testing.assert_close(sum(losses) / 2, loss.detach(), rtol=1e-5, atol=1e-6)
        if key[0] == "padded-gpt":
            assert all(torch.allclose(each, loss.detach(), rtol=1e-5, atol=1e-6) for each in losses), (losses, loss)
        for replica in (per_rank[:2], per_rank[2:]):
            grads = _merged(replica, key, "grads")
            for fqn, p in case.model.named_parameters():
                torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=f"{key} {fqn}")


@launches.READS_TWO_RANKS
def test_meta_device_model_materialises_only_local_parameters():
    per_rank = _shared("meta_init")
    case, loss = _reference("gpt")
    all_names = {n for n, _ in case.model.named_parameters()}
    materialised = [set(r["materialised"]) for r in per_rank]
    assert all(m and m < all_names for m in materialised)
    grads = {k: v for r in per_rank for k, v in r["grads"].items()}
    for fqn, p in case.model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=fqn)


def test_a_dead_peer_fails_the_others_within_the_timeout():
    """Rank 0 dies in the middle of the first step; rank 1 raises, naming the dead peer, the
    action it was waiting on and the 10 s timeout its wait had (the launch ends: no rank hangs)."""
    victim, survivor = run_ranks(2, workers.dies_mid_step, 0, allow_failures=True)
    assert isinstance(victim, Failed) and victim.exitcode == 3
    assert survivor.startswith("PeerError"), survivor
    assert "rank 0" in survivor and "RECV" in survivor and "after 10 s" in survivor, survivor


def _where_and_what(name: str) -> tuple[str, str | None]:
    import os

    return os.getcwd(), os.environ.get(name)


def test_ranks_start_in_the_launchers_directory_and_environment(tmp_path, monkeypatch):
    """Ranks are forks of a server started by an earlier launch of this process: each still
    runs in the directory and environment its launcher has now, as a freshly spawned one would."""
    run_ranks(2, _where_and_what, "ZBCOMPILE_TEST_LAUNCH")  # the server runs from here on
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZBCOMPILE_TEST_LAUNCH", "set after the server started")
    per_rank = run_ranks(2, _where_and_what, "ZBCOMPILE_TEST_LAUNCH")
    assert per_rank == [(str(tmp_path), "set after the server started")] * 2


@launches.READS_TWO_RANKS
def test_zb_auto_measures_its_costs_by_default(profiled):
    """Without options, a distributed zb-auto pipeline's first compile times calibration steps,
    chooses its cut again with what they measured (kept, or re-cut), races the schedule solved
    with measured (or, re-cut, predicted from measured) costs against the handcrafted ones on
    real steps and runs the winner from its first step, the same on every rank; gradients are
    eager's (the calibration steps leave none behind)."""
    per_rank = profiled["default"]
    assert per_rank[0]["steps"] == per_rank[1]["steps"] == 2  # the first step() had measured costs
    f, b, w, comm = per_rank[0]["costs"]
    assert per_rank[1]["costs"] == per_rank[0]["costs"]  # one decision, broadcast
    assert all(t > 0 for t in f) and b[1] > 0 and all(t > 0 for t in w) and comm > 0
    assert per_rank[0]["schedule"] == per_rank[1]["schedule"]
    assert per_rank[0]["cost_source"] == "measured", per_rank[0]["history"]
    events = [e["event"] for e in per_rank[0]["history"]]
    raced = [e for e in events if e.startswith("raced at compile: ")]
    assert raced == [f"raced at compile: {per_rank[0]['raced']} kept"], events
    assert events.index(raced[0]) == (1 if events[0].startswith("re-cut at compile") else 0), events
    _assert_eager_grads_after_steps(per_rank)


@launches.READS_TWO_RANKS
def test_the_tuner_solves_with_its_first_measurement_and_switches_after_the_same_step(profiled):
    """With the cut kept as compiled (recut=False), zb-auto times its first steps, solves with what
    it measured while steps go on, and from the same step on every rank tries the solve against
    the running schedule (rank 0 slowed 3x: the measured costs solve to another order)."""
    per_rank = profiled["slowed rank"]
    events = [e["event"] for e in per_rank[0]["history"]]
    assert events[:2] == ["solving (first measurement)", "trying the solved schedule against the running one"], events
    assert per_rank[0]["history"][0]["step"] == 2  # a warm-up step, then profile_steps=2 timed ones
    assert per_rank[0]["history"][1]["step"] == 3  # the worker waits for the solve: the next step switches
    assert events == [e["event"] for e in per_rank[1]["history"]] and any("trial" in e for e in per_rank[0]["history"])
    _kept_solve(per_rank)
    _assert_eager_grads_after_steps(per_rank)


def _kept_solve(per_rank: list[dict]) -> bool:
    """Whether the first solve was kept, the same on every rank: switched in untried (the same
    actions and programs as the running ones: nothing to try) or measured faster in its trial."""
    if not any("trial" in e for e in per_rank[0]["history"]):
        assert [e["event"] for e in per_rank[0]["history"]][-1] == "switched", per_rank[0]["history"]
        return True
    ended = [next(e for e in r["history"] if "trial" in e) for r in per_rank]
    assert ended[0]["trial"] == ended[1]["trial"] and ended[0]["event"] == ended[1]["event"], ended
    assert all(e["steps"] >= MIN_ROUNDS for e in ended[0]["trial"]["entrants"]), ended
    kept = ended[0]["trial"]["chosen"] == "solved"
    assert ended[0]["event"] == "switched" if kept else ended[0]["event"].startswith("kept the running schedule")
    return kept


@launches.READS_TWO_RANKS
def test_zb_auto_under_a_limit_below_one_f_one_b_runs_a_v_on_the_same_ranks(profiled):
    """memory_limit below 1F1B's: zb-auto compiles the model again in two chunks per rank, runs
    a V schedule, re-solves it with measured chunk costs, and gives eager's gradients."""
    per_rank = profiled["below 1f1b"]
    assert [r["placement"] for r in per_rank] == ["v", "v"]
    assert per_rank[0]["cost_source"] == ("measured" if _kept_solve(per_rank) else "static"), per_rank[0]["history"]
    assert len(per_rank[0]["costs"][0]) == 4  # measured per chunk
    assert per_rank[0]["schedule"] == per_rank[1]["schedule"]
    assert {a[0] for a in per_rank[0]["schedule"][0] if a[1] == "F"} == {"0", "3"}  # rank 0: first and last chunk
    _assert_eager_grads_after_steps(per_rank)


@launches.READS_TWO_RANKS
def test_profile_false_keeps_the_static_schedule_and_profile_true_measures_any_schedule(profiled):
    """profile=False: zb-auto times nothing and keeps the schedule solved from static estimates.
    profile=True on zb-h1 (which measures nothing by default): after a warm-up step and
    profile_steps=3 timed ones, every rank has the measured costs and runs zb-h1 built with them."""
    for rank in profiled["profile=False"]:
        assert rank["history"] is None and rank["costs"] is None and rank["steps"] == 6, rank["history"]
        assert rank["cost_source"] == "static" and rank["name"] == "zb-auto"
    measured = profiled["profile=True"]
    assert measured[0]["costs"] == measured[1]["costs"] and measured[0]["costs"] is not None
    assert measured[0]["history"][0]["step"] == 3, measured[0]["history"]
    assert all(r["name"] == "zb-h1" and r["cost_source"] == "measured" for r in measured), [r["name"] for r in measured]
    assert measured[0]["steps"] == 6 and measured[0]["history"][1]["step"] == 4, measured[0]["history"]
    for name in ("profile=False", "profile=True"):
        _assert_eager_grads_after_steps(profiled[name])


@launches.READS_TWO_RANKS
def test_auto_recompute_is_chosen_again_with_the_measured_costs_on_every_rank(profiled):
    """recompute="auto" under a limit: when zb-auto re-solves with measured costs, rank 0 chooses
    the levels again with them and every rank tries those levels' programs with the new schedule
    against the running ones, keeping the faster; the gradients stay eager's."""
    per_rank = profiled["recompute auto"]
    kept = _kept_solve(per_rank)  # the solve and its levels, tried against the running ones where they differ
    assert per_rank[0]["cost_source"] == ("measured" if kept else "static"), per_rank[0]["history"]
    events = [[e["event"] for e in r["history"]] for r in per_rank]
    assert events[0] == events[1] and events[0][1].startswith("recompute levels"), events
    before, after = events[0][1].removeprefix("recompute levels ").removesuffix(" (measured costs)").split(" -> ")
    assert str(list(per_rank[0]["levels"])) == (after if kept else before), events
    assert per_rank[0]["levels"] == per_rank[1]["levels"] and all(all(r["stage_programs"]) for r in per_rank)
    assert per_rank[0]["schedule"] == per_rank[1]["schedule"]
    _assert_eager_grads_after_steps(per_rank)


def _assert_eager_grads_after_steps(per_rank: list[dict]) -> None:
    """The ranks' gradients are eager's, accumulated over the steps they ran (no zero_grad)."""
    reference = build("gpt")
    for _ in range(per_rank[0]["steps"]):
        reference.eager_loss().backward()
    grads = {k: v for r in per_rank for k, v in r["grads"].items()}
    for fqn, p in reference.model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=fqn)


def test_world_size_that_does_not_fit_the_pipeline():
    """A 2-stage pipeline in a world of one process (in this process: the check is the same for
    any world size that is not a multiple of the pipeline's ranks)."""
    import torch.distributed as dist

    from helpers.multiprocess import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        message = workers.bad_world_size()
    finally:
        dist.destroy_process_group()
    assert "world size 1" in message and "2 ranks per pipeline" in message, message


@launches.READS_TWO_RANKS
def test_new_batch_shape_recompiles_on_every_rank():
    per_rank = _shared("new_shapes")
    reference = build("gpt")
    reference.eager_loss().backward()
    half = build("gpt")
    loss = half.loss_fn(reference.model(*[a[:4] for a in half.args]), half.target[:4])
    loss.backward()  # accumulates onto the full batch's gradients, like the two pipelined steps
    grads = {k: v for r in per_rank for k, v in r.items()}
    for fqn, p in reference.model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=fqn)


@launches.READS_TWO_RANKS
def test_ranks_may_pass_none_for_what_their_stages_do_not_read():
    """The inputs only on the first stage's rank, the target only on the last stage's: keyword
    inputs and a constant argument (masked), and zbv, whose V puts both ends on rank 0 (rank 1
    passes nothing at all). Two steps: the second follows the agreed shapes without a collective."""
    per_rank = _shared("partial")
    for run in PARTIAL_RUNS:
        name = run[0]
        case, loss = _reference(name)
        case.eager_loss().backward()  # a second step accumulates
        losses = [step for r in per_rank for step in r[run]["losses"] if step is not None]
        assert len(losses) == 2, run
        for step_loss in losses:
            torch.testing.assert_close(step_loss, loss.detach(), rtol=1e-5, atol=1e-6, msg=str(run))
        grads = {k: v for r in per_rank for k, v in r[run]["grads"].items()}
        for fqn, p in case.model.named_parameters():
            torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=f"{run}: {fqn}")


@launches.READS_TWO_RANKS
def test_batches_the_ranks_disagree_on_are_clear_errors():
    first, second = _shared("misplaced")
    for errors in (first, second):  # both ranks see what every rank passed
        message = errors["different sizes"]
        assert message.startswith("ValueError") and "rank 0" in message and "rank 1" in message, message
        assert "[4, 6]" in message and "[8, 6]" in message, message
        message = errors["first and last differ"]
        assert message.startswith("ValueError") and "first stage and the last stage" in message, message
        assert "rank 0 passed inputs of 4 samples" in message and "rank 1 a target of 8" in message, message
        message = errors["replicas differ"]
        assert message.startswith("ValueError") and "data-parallel replicas" in message, message
        assert "rank 0: 4, rank 1: 8" in message, message
    message = first["first stage without inputs"]
    assert message.startswith("ValueError") and "holds stage 0" in message and "pass the inputs" in message, message
    assert second["first stage without inputs"].startswith("PeerError"), second


@launches.READS_FOUR_RANKS
def test_pipelines_over_a_process_group_or_a_device_mesh():
    per_rank = launches.four_rank_results("groups")
    for members in (per_rank[:2], per_rank[2:]):  # one pipeline per process group
        name = members[0]["group"]["name"]
        case, loss = _reference(name)
        assert [r["group"]["loss"] is None for r in members] == [True, False], name
        torch.testing.assert_close(members[1]["group"]["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        grads = {k: v for r in members for k, v in r["group"]["grads"].items()}
        for fqn, p in case.model.named_parameters():
            torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {fqn}")
    case, loss = _reference("gpt")
    losses = [r["mesh"]["loss"] for r in per_rank if r["mesh"]["loss"] is not None]
    assert len(losses) == 2  # one per replica, each its half of the batch
    torch.testing.assert_close(sum(losses) / 2, loss.detach(), rtol=1e-5, atol=1e-6)
    for replica in (per_rank[:2], per_rank[2:]):
        grads = {k: v for r in replica for k, v in r["mesh"]["grads"].items()}
        for fqn, p in case.model.named_parameters():
            torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=f"mesh: {fqn}")
    for members in (per_rank[:2], per_rank[2:]):  # the "pp" slice of a larger mesh: one pipeline each
        assert [r["slice"]["loss"] is None for r in members] == [True, False]
        torch.testing.assert_close(members[1]["slice"]["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        grads = {k: v for r in members for k, v in r["slice"]["grads"].items()}
        for fqn, p in case.model.named_parameters():
            torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=f"slice: {fqn}")
    for r in per_rank:
        assert "process_group of 4 ranks" in r["error"] and "DeviceMesh" in r["error"], r["error"]


@launches.READS_TWO_RANKS
def test_late_messages_move_w_into_the_wait_and_change_no_bit():
    """Rank 0 sends every forward message 100 ms late, and rank 1's transport tells none arrived
    before a computation waits for it. Following readiness, rank 1 runs in that wait the W the
    plan put before the waiting computation (zb-h2: W0, before F1), every step, and W that
    preceded a send run after it; more W may move where its forecast says they fit (how many
    depends on the machine's speed: `test_readiness.py` checks that choice on logical time).
    Without, every W stays where the schedule put it. Whatever moved, each W ran before a
    computation the program puts first, and the gradients (three steps accumulated) are the
    same bits in every run and schedule, and equal eager's."""
    steps = LATE_STEPS
    per_rank = _shared("late")
    runs = list(per_rank[0])
    for schedule, follow in runs:
        if not follow:
            assert all(not any(s["moved"].values()) for r in per_rank for s in r[(schedule, follow)]["steps"]), schedule
    late = per_rank[1][("zb-h2", True)]
    assert late["overtaken"] and all(step["moved"]["past_send"] for step in late["steps"]), late
    for schedule in ("zb-h2", "zb-auto", "1f1b"):
        run = per_rank[1][(schedule, True)]
        for step in run["steps"]:
            assert set(run["overtaken"]) <= set(step["moved"]["into_wait"]), (schedule, run["overtaken"], step["moved"])
            ran = [text for text, _, _ in sorted(step["timeline"], key=lambda e: e[1])]
            for w in step["moved"]["into_wait"]:  # it ran before a computation the program puts first
                planned_before = {
                    a for a in run["program"][: run["program"].index(w)] if "SEND" not in a and "RECV" not in a
                }
                assert planned_before - set(ran[: ran.index(w)]), (schedule, w, ran)
    reference = build("gpt")
    for _ in range(steps):
        reference.eager_loss().backward()
    grads = {run: {k: v for r in per_rank for k, v in r[run]["grads"].items()} for run in runs}
    first = grads[runs[0]]
    for run in runs[1:]:
        for fqn in first:
            assert torch.equal(first[fqn], grads[run][fqn]), f"{run}: {fqn} differs from {runs[0]}"
    for fqn, p in reference.model.named_parameters():
        torch.testing.assert_close(first[fqn], p.grad, rtol=1e-5, atol=1e-6, msg=fqn)
