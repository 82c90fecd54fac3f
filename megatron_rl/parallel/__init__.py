"""The parallel layout and what crosses ranks: process groups, collectives, CPU patches,
vocab-parallel log-probs, values across pipeline stages.

Paths only tests take: `packing.py` (packed THD micro-batches) and `context.py` (context
parallelism), with the packed branches of `megatron_rl.trainer.micro_batch.PolicyMicroBatch`.
They are kept for GPU users and tested at the loss level, but the trainer pads its micro-batches
and refuses `parallel.cp > 1`: both need Transformer Engine's attention in the model
(docs/parallelism.md).
"""
