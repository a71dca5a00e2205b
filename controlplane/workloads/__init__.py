"""Workloads: the spec, its validation, and the goal-state API logic."""
