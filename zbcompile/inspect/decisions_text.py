"""What a pipeline decided by measurement, as text for people: the cut (`runtime/tuning/recut.py`), the
schedule race of its first compile (`runtime/tuning/contest.py`) and the measured-cost tuner's
decisions with their trials (`runtime/tuning/profile.py`, `runtime/tuning/schedule_trial.py`)."""

from __future__ import annotations

from typing import Any

from zbcompile.inspect.units import seconds_text


def cut_lines(cut: dict[str, Any] | None) -> list[str]:
    """What the cut chosen by measurement (`runtime/tuning/recut.py`) says: measured, chosen, why."""
    if not cut:
        return []
    measured, chosen = cut["measured"], cut["chosen"]
    speeds = ", ".join(f"{s:.2f}" for s in cut["rank_speeds"])
    return [
        f"cut by measurement: measured {measured['cut']} ({'; '.join(measured['stages'])}), predicted step "
        f"{seconds_text(measured['predicted_step_s'])}; "
        + (
            f"re-cut to {chosen['cut']} ({chosen['schedule']}), predicted step "
            f"{seconds_text(chosen['predicted_step_s'])} ({cut['predicted_gain']:.3f}x)"
            if cut["changed"] else "kept"
        ),
        f"  why: {cut['reason']}; each rank's time for the same work, relative to the fastest: {speeds}"
        + (f" (agreed over {cut['timed_steps']} timed steps)" if "timed_steps" in cut else ""),
        *(
            [f"  rival: {cut['rival']['cut']} ({cut['rival']['schedule']}), predicted step "
             f"{seconds_text(cut['rival']['predicted_step_s'])}, raced beside"]
            if "rival" in cut and "race" in cut else []
        ),
        *race_lines(cut.get("race")),
    ]


def race_lines(race: dict[str, Any] | None, title: str = "schedule raced on real steps") -> list[str]:
    """The schedule race of the compile (`runtime/tuning/contest.py`) or a trial of the tuner's
    (`runtime/tuning/schedule_trial.py`): each entrant's predicted and measured step (median, spread,
    steps timed), which was kept and why."""
    if not race:
        return []
    rows = []
    for e in race["entrants"]:
        measured = (
            f"measured {seconds_text(e['measured_step_s'])} +- {seconds_text(e['spread_s'])} over {e['steps']} steps"
            if e["measured_step_s"] is not None else "not raced"
        )
        rows.append(f"    {e['label']:<8} predicted {seconds_text(e['predicted_step_s'])}, {measured}")
    return [f"{title}: kept {race['chosen']} ({race['why']})", *rows]


def tuner_lines(history: list[dict[str, Any]]) -> list[str]:
    """The measured-cost tuner's decisions (`CostTuner.history`), each trial's entrants below it."""
    if not history:
        return []
    lines = ["measured costs, decisions while training:"]
    for entry in history:
        lines.append(f"  step {entry['step']}: {entry['event']}")
        lines += [f"  {line}" for line in race_lines(entry.get("trial"), "tried on real steps")]
    return lines
