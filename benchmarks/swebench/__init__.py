"""Replay of real coding-agent trajectories (SWE-bench tasks) with tree-search expansion, on
DeltaBox and on baselines; see README.md in this directory."""
