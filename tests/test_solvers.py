"""The checkpoint solvers: exact against brute force, never worse than the baselines, groups respected."""

import random
import sys
import time

import pytest

from memplan import solvers
from memplan.errors import BadInput
from memplan.solvers import (
    SOLVERS,
    Block,
    ChainProblem,
    Span,
    brute_force,
    every_block,
    no_checkpoint,
    solve_chain_dp,
    solve_milp,
    sqrt_n,
    uniform_k,
)

FIXED = 1000


def random_chain(rng: random.Random, n: int, max_group: int, budget_fraction: float) -> ChainProblem:
    """Blocks in runs of 1..max_group (a run of one has no group); budget = fixed + a fraction of activations."""
    blocks: list[Block] = []
    while len(blocks) < n:
        run = min(rng.randint(1, max_group), n - len(blocks))
        group = f"g{len(blocks)}" if run > 1 else ""
        for _ in range(run):
            flops, seconds = rng.randint(0, 100), rng.random()
            blocks.append(
                Block(
                    path=f"b{len(blocks)}",
                    input_bytes=rng.randint(1, 40),
                    saved_bytes=rng.randint(0, 100),
                    flops=flops,
                    seconds=seconds,
                    group=group,
                    # some blocks end in ops their segment's recomputation stops before (a last Linear)
                    spared_flops=rng.choice([0, rng.randint(0, flops)]),
                    spared_seconds=rng.choice([0.0, rng.random() * seconds]),
                )
            )
    activations = sum(b.saved_bytes for b in blocks)
    return ChainProblem(tuple(blocks), FIXED, FIXED + int(activations * budget_fraction))


def random_chains(seed: int, count: int, sizes: range, max_group: int = 5):
    rng = random.Random(seed)
    for _ in range(count):
        yield random_chain(
            rng, rng.choice(sizes), rng.randint(1, max_group), rng.choice([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
        )


def model_peak(problem: ChainProblem, segments) -> int:
    """The memory model, written out independently of the solvers."""
    saved = {b.path: b.saved_bytes for b in problem.blocks}
    inputs = {b.path: b.input_bytes for b in problem.blocks}
    checkpointed = {path for segment in segments for path in segment}
    kept = sum(b.saved_bytes for b in problem.blocks if b.path not in checkpointed)
    boundaries = sum(inputs[segment[0]] for segment in segments)
    recompute = max((sum(saved[path] for path in segment) for segment in segments), default=0)
    return problem.fixed_bytes + kept + boundaries + recompute


def check_solution(problem: ChainProblem, solution) -> None:
    """Segments are disjoint runs of consecutive blocks within one group, and the figures add up."""
    order = {b.path: i for i, b in enumerate(problem.blocks)}
    groups = {b.path: b.group for b in problem.blocks}
    covered = [path for segment in solution.segments for path in segment]
    assert len(covered) == len(set(covered))
    for segment in solution.segments:
        indices = [order[path] for path in segment]
        assert indices == list(range(indices[0], indices[0] + len(indices)))
        if len(segment) > 1:
            assert groups[segment[0]] and len({groups[path] for path in segment}) == 1
    chosen = [b for b in problem.blocks if b.path in set(covered)]
    ending = [b for b in problem.blocks if b.path in {segment[-1] for segment in solution.segments}]
    assert solution.recompute_flops == sum(b.flops for b in chosen) - sum(b.spared_flops for b in ending)
    assert solution.recompute_seconds == pytest.approx(sum(b.seconds for b in chosen) - sum(b.spared_seconds for b in ending))
    assert solution.modelled_peak_bytes == model_peak(problem, solution.segments)
    assert solution.feasible == (solution.modelled_peak_bytes <= problem.budget_bytes)


def outcome(solution) -> tuple:
    """What two exact solvers must agree on: ties in cost may be broken by different segments."""
    if solution.feasible:
        return True, solution.recompute_flops
    return False, solution.modelled_peak_bytes, solution.recompute_flops


# --------------------------------------------------------------------------------------------------
# Exactness


def test_dp_matches_brute_force():
    for problem in random_chains(seed=1, count=250, sizes=range(13)):
        dp, reference = solve_chain_dp(problem), brute_force(problem)
        check_solution(problem, dp)
        check_solution(problem, reference)
        assert outcome(dp) == outcome(reference), problem
        # both break cost ties by the lower peak
        assert dp.modelled_peak_bytes == reference.modelled_peak_bytes
        assert dp.optimality_gap == 0.0


def test_dp_matches_brute_force_on_longer_chains():
    for problem in random_chains(seed=2, count=6, sizes=range(14, 17), max_group=3):
        assert outcome(solve_chain_dp(problem)) == outcome(brute_force(problem)), problem


def test_dp_past_its_deadline_returns_a_fitting_selection_within_its_gap():
    """Past the deadline the DP stops searching and returns the cheapest fitting selection its Lagrangian
    search met: it fits wherever one fits (else it is the lowest peak), and the optimum lies within the gap."""
    for problem in random_chains(seed=3, count=150, sizes=range(1, 13)):
        reference = brute_force(problem)
        stopped = solve_chain_dp(problem, deadline=0.0)
        check_solution(problem, stopped)
        assert stopped.feasible == reference.feasible, problem
        if not reference.feasible:
            assert stopped.modelled_peak_bytes == reference.modelled_peak_bytes
            continue
        assert 0.0 <= stopped.optimality_gap < 1.0 or stopped.recompute_flops == reference.recompute_flops == 0
        assert stopped.recompute_flops >= reference.recompute_flops
        assert reference.recompute_flops >= stopped.recompute_flops * (1 - stopped.optimality_gap) - 1, problem


def test_dp_minimises_seconds_when_asked():
    for problem in random_chains(seed=3, count=60, sizes=range(1, 11)):
        dp = solve_chain_dp(problem, objective="seconds")
        reference = brute_force(problem, objective="seconds")
        check_solution(problem, dp)
        assert dp.feasible == reference.feasible
        assert dp.recompute_seconds == pytest.approx(reference.recompute_seconds)


def test_infeasible_budget_gives_the_lowest_reachable_peak():
    for problem in random_chains(seed=4, count=60, sizes=range(1, 11)):
        hopeless = ChainProblem(problem.blocks, FIXED, FIXED)  # no room for any activation
        if not any(b.saved_bytes for b in problem.blocks):
            continue
        reference = brute_force(hopeless)
        assert not reference.feasible
        for solution in (solve_chain_dp(hopeless), solve_milp(hopeless)):
            check_solution(hopeless, solution)
            assert not solution.feasible
            assert solution.modelled_peak_bytes == reference.modelled_peak_bytes
            assert solution.recompute_flops == reference.recompute_flops  # the cheapest at that peak


def test_milp_matches_dp():
    for problem in random_chains(seed=5, count=60, sizes=range(1, 21)):
        milp, dp = solve_milp(problem), solve_chain_dp(problem)
        check_solution(problem, milp)
        assert outcome(milp) == outcome(dp), problem
        assert milp.optimality_gap == pytest.approx(0.0)


def test_milp_minimises_seconds_when_asked():
    for problem in random_chains(seed=6, count=15, sizes=range(1, 15)):
        milp, dp = solve_milp(problem, objective="seconds"), solve_chain_dp(problem, objective="seconds")
        assert milp.feasible == dp.feasible
        assert milp.recompute_seconds == pytest.approx(dp.recompute_seconds, rel=1e-6)


@pytest.mark.parametrize("cut", [0.25, 0.5, 0.75])
def test_dp_is_never_worse_than_a_fitting_baseline(cut):
    rng = random.Random(int(cut * 100))
    for _ in range(25):
        problem = random_chain(rng, rng.randint(10, 40), rng.randint(1, 12), 1 - cut)
        dp = solve_chain_dp(problem)
        check_solution(problem, dp)
        baselines = [no_checkpoint(problem), every_block(problem), sqrt_n(problem)]
        baselines += [uniform_k(problem, k) for k in (2, 3, 4, 8)]
        for baseline in baselines:
            check_solution(problem, baseline)
            if baseline.feasible:
                assert dp.feasible and dp.recompute_flops <= baseline.recompute_flops, baseline.method
            else:
                assert dp.modelled_peak_bytes <= baseline.modelled_peak_bytes or dp.feasible


# --------------------------------------------------------------------------------------------------
# Groups, baselines, hierarchy


def test_segments_never_cross_group_boundaries():
    def chain(first_group: str, second_group: str) -> ChainProblem:
        # e's recomputation sets the max term anyway, so merging a..d into one segment would cost nothing
        # there and save three boundaries
        blocks = [Block(path, 50, 50, 5, group=first_group) for path in "ab"]
        blocks += [Block(path, 50, 50, 5, group=second_group) for path in "cd"]
        return ChainProblem((*blocks, Block("e", 10, 200, 5)), 0, 0)

    assert solve_chain_dp(chain("x", "x")).segments == (("a", "b", "c", "d"), ("e",))
    problem = chain("x", "y")
    for solution in (solve_chain_dp(problem), solve_milp(problem), brute_force(problem), sqrt_n(problem)):
        check_solution(problem, solution)
    assert solve_chain_dp(problem).segments == (("a", "b"), ("c", "d"), ("e",))
    assert solve_milp(problem).segments == (("a", "b"), ("c", "d"), ("e",))


def test_uniform_k_does_what_checkpoint_sequential_does():
    blocks = tuple(Block(f"seq.{i}", 1, 10, 1, group="seq") for i in range(10))
    problem = ChainProblem(blocks, 0, 10**6)
    # 10 // 3 = 3 blocks a segment; the last segment (with the remainder) is not checkpointed
    assert uniform_k(problem, 3).segments == (("seq.0", "seq.1", "seq.2"), ("seq.3", "seq.4", "seq.5"))
    assert uniform_k(problem, 1).segments == ()
    assert uniform_k(problem, 20).segments == ()  # n // k = 0, as in torch: nothing checkpointed
    assert sqrt_n(problem).segments == (
        ("seq.0", "seq.1", "seq.2"),
        ("seq.3", "seq.4", "seq.5"),
        ("seq.6", "seq.7", "seq.8"),
        ("seq.9",),
    )
    assert every_block(problem).segments == tuple((b.path,) for b in blocks)
    assert no_checkpoint(problem).segments == ()


def test_baselines_split_segments_at_group_boundaries():
    blocks = tuple(Block(f"b{i}", 1, 10, 1, group="g" if i < 2 else "") for i in range(4))
    assert sqrt_n(ChainProblem(blocks, 0, 0)).segments == (("b0", "b1"), ("b2",), ("b3",))


def random_spans_problem(rng: random.Random, n: int) -> ChainProblem:
    """Blocks with an arbitrary set of allowed spans (nested, overlapping, some blocks in none), each span
    keeping an input of its own."""
    blocks = tuple(Block(f"b{i}", 0, rng.randint(0, 100), rng.randint(0, 100), rng.random()) for i in range(n))
    ends = {(first, rng.randint(first, min(n - 1, first + 4))) for first in rng.choices(range(n), k=rng.randint(0, 2 * n))}
    spans = tuple(
        # some spans free less than their blocks save (an output that a later op keeps), and some recompute
        # less than their blocks (ops past the early stop)
        Span(first, last, rng.randint(1, 40), (f"s{first}-{last}",),
             rng.choice([None, rng.randint(0, sum(b.saved_bytes for b in blocks[first : last + 1]))]),
             rng.choice([1, 1, 2, 3]),  # a module called 2 or 3 times is recomputed at every call
             rng.choice([0, rng.randint(0, sum(b.flops for b in blocks[first : last + 1]))]))
        for first, last in sorted(ends)
    )
    activations = sum(b.saved_bytes for b in blocks)
    return ChainProblem(blocks, FIXED, FIXED + int(activations * rng.choice([0.0, 0.3, 0.6, 0.9])), spans)


def spans_peak(problem: ChainProblem, segments) -> int:
    """The memory model for explicit spans, written out independently of the solvers."""
    by_paths = {span.paths: span for span in problem.spans}
    chosen = [by_paths[segment] for segment in segments]
    inside = [
        sum(b.saved_bytes for b in problem.blocks[s.first : s.last + 1]) if s.saved_bytes is None else s.saved_bytes
        for s in chosen
    ]
    kept = sum(b.saved_bytes for b in problem.blocks) - sum(inside)
    return problem.fixed_bytes + kept + sum(s.input_bytes for s in chosen) + max(inside, default=0)


def test_dp_and_milp_on_explicit_spans_match_brute_force():
    rng = random.Random(7)
    for _ in range(150):
        problem = random_spans_problem(rng, rng.randint(1, 10))
        reference = brute_force(problem)
        for solution in (solve_chain_dp(problem), solve_milp(problem)):
            covered = [i for segment in solution.segments for span in problem.spans if span.paths == segment
                       for i in range(span.first, span.last + 1)]
            assert len(covered) == len(set(covered))  # chosen spans never overlap
            assert solution.modelled_peak_bytes == spans_peak(problem, solution.segments)
            chosen = [span for segment in solution.segments for span in problem.spans if span.paths == segment]
            assert solution.recompute_flops == sum(
                (sum(b.flops for b in problem.blocks[s.first : s.last + 1]) - s.spared_flops) * s.calls for s in chosen)
            assert outcome(solution) == outcome(reference), problem


def test_baselines_refuse_explicit_spans():
    problem = ChainProblem((Block("a", 1, 1, 1),), 0, 10, (Span(0, 0, 1, ("a",)),))
    for baseline in (every_block, sqrt_n):
        with pytest.raises(BadInput, match="explicit spans"):
            baseline(problem)


# --------------------------------------------------------------------------------------------------
# Inputs, registry, environment


def test_bad_inputs_are_rejected():
    with pytest.raises(BadInput, match="not consecutive"):
        ChainProblem((Block("a", 1, 1, 1, group="g"), Block("b", 1, 1, 1), Block("c", 1, 1, 1, group="g")), 0, 0)
    with pytest.raises(BadInput, match="duplicate"):
        ChainProblem((Block("a", 1, 1, 1), Block("a", 1, 1, 1)), 0, 0)
    with pytest.raises(BadInput, match="negative"):
        ChainProblem((Block("a", 1, -1, 1),), 0, 0)
    with pytest.raises(BadInput, match="out of range"):
        ChainProblem((Block("a", 1, 1, 1),), 0, 0, (Span(0, 1, 1, ("a",)),))
    with pytest.raises(BadInput, match="two spans"):
        ChainProblem((Block("a", 1, 1, 1),), 0, 0, (Span(0, 0, 1, ("a",)), Span(0, 0, 2, ("b",))))
    problem = ChainProblem(tuple(Block(f"b{i}", 1, 1, 1) for i in range(17)), 0, 100)
    with pytest.raises(BadInput, match="objective"):
        solve_chain_dp(problem, objective="joules")
    with pytest.raises(BadInput, match="at most 16"):
        brute_force(problem)
    with pytest.raises(BadInput, match="k >= 1"):
        uniform_k(problem, 0)


def test_empty_chain():
    problem = ChainProblem((), 100, 200)
    for solve in SOLVERS.values():
        solution = solve(problem)
        assert solution.segments == () and solution.feasible and solution.modelled_peak_bytes == 100


def test_registry_names_match_methods():
    problem = next(random_chains(seed=8, count=1, sizes=range(6, 7)))
    for name, solve in SOLVERS.items():
        assert solve(problem).method == name


def test_milp_out_of_time_returns_what_it_has_and_no_gap(monkeypatch):
    """HiGHS stopped by the deadline before any selection: an empty one with no gap, not an error; given
    time, the MILP proves the DP's optimum."""
    monkeypatch.setattr(solvers, "MILP_MIN_SOLVE_S", 0.0)
    out_of_time = 0
    for problem in random_chains(seed=21, count=10, sizes=range(8, 13)):
        optimum = solve_chain_dp(problem).recompute_flops
        hurried = solve_milp(problem, deadline=time.perf_counter() - 1.0)
        if hurried.optimality_gap is None:  # HiGHS's presolve alone solves some of these
            assert hurried.segments == ()
            out_of_time += 1
        else:
            assert hurried.optimality_gap == 0.0 and hurried.recompute_flops == optimum
        given_time = solve_milp(problem, deadline=time.perf_counter() + 30.0)
        assert given_time.optimality_gap == 0.0 and given_time.recompute_flops == optimum
    assert out_of_time > 0


def test_milp_without_scipy_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with pytest.raises(BadInput, match="pip install scipy"):
        solve_milp(ChainProblem((Block("a", 1, 1, 1),), 0, 10))


def test_milp_keeps_stdout_clean(capfd):
    # this instance makes HiGHS 1.12 print a stray debug line (ERGO-Code/HiGHS#2783) in its min-peak solve
    rows = [(14, 97, 100, "g0"), (14, 98, 31, "g0"), (25, 97, 46, "g1"), (32, 16, 14, "g1"), (39, 67, 46, "")]
    rows += [(15, 1, 72, "g3"), (32, 84, 95, "g3"), (6, 40, 34, "g3")]
    blocks = tuple(Block(f"b{i}", inp, saved, flops, group=g) for i, (inp, saved, flops, g) in enumerate(rows))
    solve_milp(ChainProblem(blocks, 1000, 1050))
    assert capfd.readouterr().out == ""
