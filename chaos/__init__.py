"""Fault-injection runs: kill, pause and cut off processes, then check that nothing is lost."""
