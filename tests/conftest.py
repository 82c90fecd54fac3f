"""The test process computes on one torch thread, as each rank that torchrun starts does
(OMP_NUM_THREADS=1) and as `megatron-rl train` runs in the tests (tests/trainer/run_cli.py).
On the 2-core CI machine the tiny models' operations gain nothing from a second thread, and
torch's threads wait for each other on a busy machine: a test of the in-process engine took
14 s with 2 threads, 0.6 s with 1."""

import torch

torch.set_num_threads(1)
