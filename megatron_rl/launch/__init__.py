"""Launching runs on clusters: SLURM batch scripts (slurm), one node's trainer ranks (node), and
the rollout servers of a job's rollout nodes (rollout_server). docs/slurm.md."""
