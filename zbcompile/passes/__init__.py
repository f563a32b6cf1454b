"""Compiler passes. Each file holds one pass: a function named by what it does that reads one
IR and returns a frozen dataclass holding the next one; none of them mutates its input."""
