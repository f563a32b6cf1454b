"""Executes compiled stage programs: per-stage execution (`stage`), the single-process runner
(`local`)."""
