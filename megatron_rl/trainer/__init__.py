"""The RL trainer: the recipe, micro-batches and the schedule, the policy and its optimizer, the
learning and rollout halves of a step, weight sync, training checkpoints, metrics and the loop
(`loop.py`)."""
