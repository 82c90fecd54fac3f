"""`megatron-rl` command line. Each subcommand parses its arguments and calls one library entry."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rl.bench import logprobs as logprobs_bench
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


def _bench_logprobs(args: argparse.Namespace) -> int:
    spec = logprobs_bench.LogprobBenchSpec(
        tokens=args.tokens,
        vocab=args.vocab,
        dtype=args.dtype,
        repeats=args.repeats,
        chunk_tokens=args.chunk_tokens,
        threads=args.threads,
    )
    report = logprobs_bench.run_benchmark(spec)
    print(logprobs_bench.format_markdown(report))
    json_path, md_path = logprobs_bench.write_report(report, Path(args.out))
    print(f"\nwrote {json_path} and {md_path}")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


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

    bench = commands.add_parser("bench", help="benchmarks (results as JSON and markdown)")
    benches = bench.add_subparsers(dest="bench", required=True)
    logprobs = benches.add_parser(
        "logprobs",
        help="log-probs + entropy forward/backward: chunked kernel vs naive log_softmax",
    )
    logprobs.add_argument("--tokens", type=_positive, default=4096, help="tokens (default 4096)")
    logprobs.add_argument(
        "--vocab", type=_positive, default=151_936, help="vocabulary size (default Qwen3's)"
    )
    logprobs.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    logprobs.add_argument("--repeats", type=_positive, default=3, help="timed repeats")
    logprobs.add_argument(
        "--chunk-tokens", type=_positive, default=None, help="tokens per chunk (default: auto)"
    )
    logprobs.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: torch's default)"
    )
    logprobs.add_argument("--out", default="runs/bench", help="directory for the JSON and .md")
    logprobs.set_defaults(handler=_bench_logprobs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
