"""Solve time of the exact chain solvers (DP, MILP) on random chains of 25..200 blocks.

Blocks are transformer-like at random: each saves 50..500 MiB for backward, takes a 5..50 MiB input, and
costs 5k..20k FLOPs per saved byte; they come in runs of 1..--max-group siblings (a run may share one
segment). The budget leaves (1 - cut) of the activation memory. The target: under 2 s for 100 blocks.

    python benchmarks/solver_speed.py [--sizes 25,50,100,200] [--cuts 0.25,0.5,0.75] [--max-group 12]
                                      [--identical] [--nested] [--no-milp] [--milp-time-limit 60] [--seed 0]

--nested gives each block 4..8 submodules, any of which (or a neighbouring pair) may be a segment, as the
planner's candidates at every depth; the DP then works on the submodules (the blocks column counts blocks).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memplan.solvers import Block, ChainProblem, Span, solve_chain_dp, solve_milp

MiB = 2**20
FIXED = 10 * 2**30


def random_chain(rng: random.Random, n: int, cut: float, max_group: int, identical: bool) -> ChainProblem:
    blocks: list[Block] = []
    first = (rng.randint(5, 50) * MiB, rng.randint(50, 500) * MiB, rng.uniform(5e3, 2e4))
    while len(blocks) < n:
        run = min(rng.randint(1, max_group), n - len(blocks))
        group = f"layer{len(blocks)}" if run > 1 else ""
        for _ in range(run):
            input_bytes, saved, flops_per_byte = (
                first if identical else (rng.randint(5, 50) * MiB, rng.randint(50, 500) * MiB, rng.uniform(5e3, 2e4))
            )
            blocks.append(Block(f"b{len(blocks)}", input_bytes, saved, int(saved * flops_per_byte), group=group))
    activations = sum(b.saved_bytes for b in blocks)
    return ChainProblem(tuple(blocks), FIXED, FIXED + int(activations * (1 - cut)))


def random_nested(rng: random.Random, n: int, cut: float) -> ChainProblem:
    """n transformer-like blocks of one stack, each made of 4..8 submodules (the leaves): any run of whole
    blocks, any one block, any one submodule or pair of neighbouring submodules may be a segment."""
    leaves: list[Block] = []
    spans: list[Span] = []
    starts = []
    for b in range(n):
        starts.append(len(leaves))
        for s in range(rng.randint(4, 8)):
            saved = rng.randint(5, 100) * MiB
            leaves.append(Block(f"b{b}.m{s}", 0, saved, int(saved * rng.uniform(0, 2e4))))
            spans.append(Span(len(leaves) - 1, len(leaves) - 1, rng.randint(5, 50) * MiB, (f"b{b}.m{s}",)))
            if s:
                spans.append(Span(len(leaves) - 2, len(leaves) - 1, spans[-2].input_bytes, (f"b{b}.m{s - 1}", f"b{b}.m{s}")))
    starts.append(len(leaves))
    block_input = [spans[[sp.first for sp in spans].index(start)].input_bytes for start in starts[:-1]]
    for first in range(n):
        for last in range(first, n):
            spans.append(Span(starts[first], starts[last + 1] - 1, block_input[first],
                              tuple(f"b{b}" for b in range(first, last + 1))))
    activations = sum(leaf.saved_bytes for leaf in leaves)
    return ChainProblem(tuple(leaves), FIXED, FIXED + int(activations * (1 - cut)), tuple(spans))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25,50,100,200")
    parser.add_argument("--cuts", default="0.25,0.5,0.75", help="fractions of activation memory to save")
    parser.add_argument("--max-group", type=int, default=12, help="longest run of siblings")
    parser.add_argument("--identical", action="store_true", help="all blocks alike (a stack of equal layers)")
    parser.add_argument("--milp-time-limit", type=float, default=60.0, help="seconds for the MILP per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nested", action="store_true", help="blocks of 4..8 submodules, as the planner builds")
    parser.add_argument("--no-milp", action="store_true", help="time the DP alone")
    args = parser.parse_args()

    rows = []
    for n in (int(size) for size in args.sizes.split(",")):
        for cut in (float(c) for c in args.cuts.split(",")):
            rng = random.Random(args.seed * 1000 + n)
            problem = random_nested(rng, n, cut) if args.nested else random_chain(rng, n, cut, args.max_group, args.identical)
            dp = solve_chain_dp(problem)
            milp = None if args.no_milp else solve_milp(problem, deadline=time.perf_counter() + args.milp_time_limit)
            segments = sum(len(paths) for paths in dp.segments)
            rows.append(
                (
                    n,
                    f"{cut:.0%}",
                    f"{dp.solve_seconds:.3f}",
                    f"{milp.solve_seconds:.3f}" if milp else "-",
                    (f"{milp.optimality_gap:.1e}" if milp.optimality_gap else "0") if milp else "-",
                    ("yes" if milp.recompute_flops == dp.recompute_flops else "no") if milp else "-",
                    f"{len(dp.segments)} / {segments}",
                    "yes" if dp.feasible else "no",
                )
            )
            print(f"... {n} blocks, cut {cut:.0%}", file=sys.stderr)
    headers = ("blocks", "cut", "DP s", "MILP s", "MILP gap", "same cost", "segments / blocks in them", "fits")
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
