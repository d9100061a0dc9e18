"""Slow tier: multi-rank launches (torchrun, simulated SLURM nodes, the lit-mesh command)."""
