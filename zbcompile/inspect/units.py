"""Numbers as people read them: SI prefixes, and seconds in the unit that reads best."""

from __future__ import annotations


def si(value: float, unit: str = "") -> str:
    """`1234567` -> `1.23 M`; units after the prefix (`si(2048, "B")` -> `2.05 kB`)."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def seconds_text(seconds: float) -> str:
    """Seconds in the unit that reads best: s, ms or µs."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.2f} µs"
