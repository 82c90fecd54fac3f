"""`megatron-rl train` with one gradient entry set to inf after every backward (fault injection for
the tests): the loss stays finite, the gradient norm does not, and the loop must skip, show, count
and finally abort."""

from __future__ import annotations

import math
import sys

from megatron_rl import cli
from megatron_rl.trainer import policy

_real_forward_backward = policy.policy_forward_backward


def _inf_gradient(model, *args, **kwargs):
    result = _real_forward_backward(model, *args, **kwargs)
    next(iter(model.parameters())).main_grad.view(-1)[0] = math.inf
    return result


if __name__ == "__main__":
    policy.policy_forward_backward = _inf_gradient
    sys.exit(cli.main(sys.argv[1:]))
