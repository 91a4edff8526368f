"""The checkpoint solvers: exact against brute force, never worse than the baselines, groups respected."""

import itertools
import random
import sys

import pytest

from memplan.errors import BadInput
from memplan.solvers import (
    SOLVERS,
    Block,
    Candidate,
    ChainProblem,
    HierarchyProblem,
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
            blocks.append(
                Block(
                    path=f"b{len(blocks)}",
                    input_bytes=rng.randint(1, 40),
                    saved_bytes=rng.randint(0, 100),
                    flops=rng.randint(0, 100),
                    seconds=rng.random(),
                    group=group,
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
    assert solution.recompute_flops == sum(b.flops for b in chosen)
    assert solution.recompute_seconds == pytest.approx(sum(b.seconds for b in chosen))
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


def random_hierarchy(rng: random.Random, size: int) -> HierarchyProblem:
    candidates: list[Candidate] = []
    for i in range(size):
        parent = rng.choice([None, *[c.path for c in candidates]])
        candidates.append(Candidate(f"m{i}", parent, rng.randint(1, 30), 0, rng.randint(1, 100)))
    # a candidate saves its own activations plus everything its submodules save
    own = {c.path: rng.randint(0, 80) for c in candidates}
    children = {c.path: [d.path for d in candidates if d.parent_path == c.path] for c in candidates}

    def subtree(path: str) -> int:
        return own[path] + sum(subtree(child) for child in children[path])

    candidates = [Candidate(c.path, c.parent_path, c.input_bytes, subtree(c.path), c.flops) for c in candidates]
    total = sum(c.saved_bytes for c in candidates if c.parent_path is None)
    return HierarchyProblem(tuple(candidates), FIXED, FIXED + int(total * rng.choice([0.0, 0.3, 0.6, 0.9])))


def hierarchy_brute_force(problem: HierarchyProblem) -> tuple:
    """The best outcome over every set of candidates where none contains another."""
    parent = {c.path: c.parent_path for c in problem.candidates}

    def ancestors(path):
        while parent[path] is not None:
            path = parent[path]
            yield path

    total = sum(c.saved_bytes for c in problem.candidates if c.parent_path is None)
    best = None
    for size in range(len(problem.candidates) + 1):
        for chosen in itertools.combinations(problem.candidates, size):
            paths = {c.path for c in chosen}
            if any(a in paths for c in chosen for a in ancestors(c.path)):
                continue
            peak = (
                problem.fixed_bytes
                + total
                - sum(c.saved_bytes - c.input_bytes for c in chosen)
                + max((c.saved_bytes for c in chosen), default=0)
            )
            cost = sum(c.flops for c in chosen)
            rank = (0, cost) if peak <= problem.budget_bytes else (1, peak, cost)
            best = rank if best is None else min(best, rank)
    return best


def test_milp_on_nested_candidates_matches_brute_force():
    rng = random.Random(7)
    for _ in range(40):
        problem = random_hierarchy(rng, rng.randint(1, 9))
        solution = solve_milp(problem)
        chosen = {path for segment in solution.segments for path in segment}
        parent = {c.path: c.parent_path for c in problem.candidates}
        for path in chosen:
            while parent[path] is not None:
                path = parent[path]
                assert path not in chosen  # no chosen candidate inside another
        rank = (
            (0, solution.recompute_flops)
            if solution.feasible
            else (1, solution.modelled_peak_bytes, solution.recompute_flops)
        )
        assert rank == hierarchy_brute_force(problem), problem


# --------------------------------------------------------------------------------------------------
# Inputs, registry, environment


def test_bad_inputs_are_rejected():
    with pytest.raises(BadInput, match="not consecutive"):
        ChainProblem((Block("a", 1, 1, 1, group="g"), Block("b", 1, 1, 1), Block("c", 1, 1, 1, group="g")), 0, 0)
    with pytest.raises(BadInput, match="duplicate"):
        ChainProblem((Block("a", 1, 1, 1), Block("a", 1, 1, 1)), 0, 0)
    with pytest.raises(BadInput, match="negative"):
        ChainProblem((Block("a", 1, -1, 1),), 0, 0)
    with pytest.raises(BadInput, match="not a candidate"):
        HierarchyProblem((Candidate("a", "nowhere", 1, 1, 1),), 0, 0)
    with pytest.raises(BadInput, match="cycle"):
        HierarchyProblem((Candidate("a", "b", 1, 1, 1), Candidate("b", "a", 1, 1, 1)), 0, 0)
    problem = ChainProblem(tuple(Block(f"b{i}", 1, 1, 1) for i in range(17)), 0, 100)
    with pytest.raises(BadInput, match="objective"):
        solve_chain_dp(problem, objective="joules")
    with pytest.raises(BadInput, match="at most 16"):
        brute_force(problem)
    with pytest.raises(BadInput, match="k >= 1"):
        uniform_k(problem, 0)


def test_empty_chain():
    problem = ChainProblem((), 100, 200)
    for name, solve in SOLVERS.items():
        solution = solve(problem, k=2) if name == "uniform-k" else solve(problem)
        assert solution.segments == () and solution.feasible and solution.modelled_peak_bytes == 100


def test_registry_names_match_methods():
    problem = next(random_chains(seed=8, count=1, sizes=range(6, 7)))
    for name, solve in SOLVERS.items():
        assert (solve(problem, k=2) if name == "uniform-k" else solve(problem)).method == name


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
