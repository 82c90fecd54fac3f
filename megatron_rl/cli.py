"""`megatron-rl` command line. Each subcommand parses its arguments and calls one library entry."""

from __future__ import annotations

import argparse
import json
import sys

from megatron_rl.bench.loss_table import DriftBatchSpec, format_markdown, loss_table
from megatron_rl.fileio import write_text_atomic


def _losses(args: argparse.Namespace) -> int:
    spec = DriftBatchSpec(seed=args.seed, routing_changed_frac=args.routing_changed_frac)
    rows = loss_table(spec)
    print(
        f"Policy losses on a synthetic batch of {spec.prompts} prompts x {spec.group_size} "
        f"responses (up to {spec.max_response_len} tokens), {spec.routing_changed_frac:.0%} of "
        f"tokens with routing-sized log-ratio shifts (std {spec.routing_changed_std}), seed "
        f"{spec.seed}:\n"
    )
    print(format_markdown(rows))
    if args.json:
        write_text_atomic(args.json, json.dumps({"spec": vars(spec), "rows": rows}, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    losses = commands.add_parser(
        "losses",
        help="compare every registered policy loss on one synthetic MoE-drift batch",
        description="Evaluate every registered policy loss at its default clip range on a "
        "synthetic rollout batch and print where each one clips.",
    )
    losses.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch")
    losses.add_argument(
        "--routing-changed-frac",
        type=_fraction,
        default=0.1,
        help="share of tokens whose log-prob moves as if their experts changed (default 0.1)",
    )
    losses.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    losses.set_defaults(handler=_losses)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
