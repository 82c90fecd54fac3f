"""The parallel layout and what crosses ranks: process groups, collectives, CPU patches,
vocab-parallel log-probs, values across pipeline stages.

`packing.py` turns packed (THD) micro-batches into the loss's rows (`run.packed_sequences`; the
model's attention over them: `megatron_rl.models.packed_attention`). A path only tests take:
`context.py` (context parallelism), kept for GPU users and tested at the loss level; the trainer
refuses `parallel.cp > 1`, which needs Transformer Engine's attention in the model
(docs/parallelism.md).
"""
