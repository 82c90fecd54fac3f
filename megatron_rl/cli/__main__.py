"""`python -m megatron_rl.cli`: the `megatron-rl` command (torchrun starts its ranks this way)."""

import sys

from megatron_rl.cli import main

# The guard matters: megatron-core's checkpoint writer starts processes that import this module.
if __name__ == "__main__":
    sys.exit(main())
