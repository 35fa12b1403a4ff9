"""Unit tests of eval's pure pieces: metrics, the decision, greedy equivalence, the statistics of verify and how
the cost ratios are timed."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama

from specdec.eval import decision, equivalence, metrics
from specdec.eval.timing import measure_costs
from specdec.eval.verify import chi2_sf, goodness_of_fit, homogeneity, pool_cells, tv_tolerance


def test_percentiles_interpolate_linearly():
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert metrics.percentile(values, 50) == pytest.approx(5.5)
    assert metrics.percentile(values, 0) == 1 and metrics.percentile(values, 100) == 10
    assert metrics.percentile(values, 95) == pytest.approx(9.55)
    assert metrics.percentiles([3.0], (50, 99)) == {"p50": 3.0, "p99": 3.0}
    assert metrics.percentiles([], (50,)) == {"p50": None}
    with pytest.raises(ValueError):
        metrics.percentile(values, 101)


def test_ttft_and_itl_spread_each_step_over_its_tokens():
    ttft, itl = metrics.ttft_and_itl([(0.5, 1), (0.7, 1), (1.3, 3), (1.3, 0)])
    assert ttft == 0.5
    assert itl == pytest.approx([0.2, 0.2, 0.2, 0.2])
    assert metrics.ttft_and_itl([]) == (None, [])


def test_throughput_and_speedup():
    assert metrics.tokens_per_second(100, 4.0) == 25.0
    assert metrics.tokens_per_second(5, 0.0) == 0.0
    assert metrics.speedup(3.0, 2.0) == 1.5
    with pytest.raises(ValueError):
        metrics.speedup(1.0, 0.0)


def test_expected_tokens_and_analytical_speedup_match_the_closed_form():
    assert metrics.expected_tokens_per_round([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert metrics.expected_tokens_per_round([1.0, 0.0, 1.0]) == 2.0
    for alpha, k, c in [(0.6, 4, 0.1), (0.8, 2, 0.3), (1.0, 3, 0.05)]:
        general = metrics.analytical_speedup([alpha] * k, c, 1.0)
        assert general == pytest.approx(metrics.leviathan_speedup(alpha, k, c))
    # a zero-cost draft and free verification of k+1 tokens: speedup = tau_hat
    assert metrics.analytical_speedup([1.0, 1.0], 0.0, 1.0) == 3.0
    assert metrics.analytical_speedup([0.5], 0.2, 2.0) == pytest.approx(1.5 / 2.2)
    with pytest.raises(ValueError):
        metrics.analytical_speedup([], 0.1)


def test_generated_lengths_and_first_mismatch():
    assert metrics.generated_lengths([[5, 6, 2, 0, 0], [5, 6, 7]], eos_token_id=2) == [3, 3]
    assert metrics.generated_lengths([[2, 2]], eos_token_id=[9, 2]) == [1]
    assert metrics.generated_lengths([[4, 2]], eos_token_id=None) == [2]
    assert metrics.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert metrics.first_mismatch([1, 2], [1, 2, 3]) == 2


def test_memory_overhead_adds_the_draft_weights_back():
    assert metrics.memory_overhead_mb([1000.0], [1030.0], 50.0) == 80.0
    assert metrics.memory_overhead_mb([1000.0], [990.0], 50.0) == 50.0


def test_memory_overhead_pairs_the_calls_on_the_same_prompts():
    # A long prompt sets both modes' peaks (1030, 1032); on a short one speculation adds 20 MB, which a
    # comparison of the overall peaks (1032 - 1030) would hide.
    assert metrics.memory_overhead_mb([1030.0, 1000.0], [1032.0, 1020.0], 10.0) == 30.0
    with pytest.raises(ValueError, match="one speculative peak per baseline peak"):
        metrics.memory_overhead_mb([1000.0], [], 10.0)


def test_cdf():
    xs, ys = metrics.cdf([3, 1, 2])
    assert xs == [1, 2, 3] and ys == pytest.approx([1 / 3, 2 / 3, 1])


@pytest.mark.parametrize(
    ("acc", "speedup", "eq", "overhead", "verdict", "failing"),
    [
        (0.6, 1.2, True, 55.0, "enable", []),
        (0.4, 1.2, True, 55.0, "keep-target-only", ["acceptance_rate"]),
        (0.6, 1.05, True, 55.0, "keep-target-only", ["speedup"]),
        (0.6, 1.2, False, 55.0, "keep-target-only", ["equivalence"]),
        (0.6, 1.2, None, 55.0, "keep-target-only", ["equivalence"]),
        (0.6, 1.2, True, 61.0, "keep-target-only", ["memory"]),
        (0.5, 1.1, True, 60.0, "enable", []),  # thresholds are inclusive
        (0.4, 1.0, True, 61.0, "keep-target-only", ["acceptance_rate", "speedup", "memory"]),
    ],
)
def test_decision_needs_every_check(acc, speedup, eq, overhead, verdict, failing):
    # the draft may add 20% (the default) of target-only's 300 MB: 60 MB
    out = decision.decide(acc, speedup, eq, overhead, target_only_mb=300.0)
    assert out["verdict"] == verdict
    assert sorted(k for k, ok in out["checks"].items() if not ok) == sorted(failing)
    assert out["failed_gates"] == failing  # in the checks' order
    assert len(out["reasons"]) == 4
    assert sum("FAILS" in r for r in out["reasons"]) == len(failing)
    assert "of target-only 300.0 MB" in out["reasons"][3]


def test_memory_limit_is_a_share_of_target_only_memory():
    assert decision.Thresholds(max_memory_overhead=0.25).memory_limit_mb(400.0) == 100.0
    assert decision.threshold_checks(0.5, 1.1, 100.0, 400.0, decision.Thresholds(max_memory_overhead=0.25)) == {
        "acceptance_rate": True, "speedup": True, "memory": True}
    with pytest.raises(ValueError, match="fraction of target-only memory"):
        decision.Thresholds(max_memory_overhead=-0.1)


def _failed(acceptance: dict, predicted: dict, memory_mb: dict, thresholds=None) -> dict:
    """Each candidate's failed gates, target-only holding 1000 MB."""
    thresholds = thresholds or decision.Thresholds()
    return {p: decision.failed_gates(decision.threshold_checks(acceptance[p], predicted[p], memory_mb[p], 1000.0,
                                                               thresholds)) for p in acceptance}


def test_the_choice_is_the_fastest_candidate_that_passes_every_threshold():
    """A real run's figures: tree 2x1 predicted fastest at acceptance 0.381, k = 1 passing at 0.52."""
    acceptance = {1: 0.52, 2: 0.45, "2x1": 0.381, 3: 0.55}
    predicted = {1: 1.255, 2: 1.27, "2x1": 1.31, 3: 1.05}
    failed = _failed(acceptance, predicted, dict.fromkeys(acceptance, 50.0))
    assert failed == {1: [], 2: ["acceptance_rate"], "2x1": ["acceptance_rate"], 3: ["speedup"]}
    chosen, fastest = decision.prefer_passing(list(acceptance), lambda p: -predicted[p], failed)
    assert (chosen, fastest) == (1, "2x1")
    # the memory gate weighs in alike: k = 1 over its allowance (20% of 1000 MB) leaves no candidate passing,
    # and the fastest overall is kept
    failed = _failed(acceptance, predicted, {1: 250.0, 2: 50.0, "2x1": 50.0, 3: 50.0})
    assert failed[1] == ["memory"]
    assert decision.prefer_passing(list(acceptance), lambda p: -predicted[p], failed) == ("2x1", "2x1")
    # thresholds that every candidate meets: the fastest is chosen
    open_gates = decision.Thresholds(0.0, 0.01, 1.0)
    failed = _failed(acceptance, predicted, dict.fromkeys(acceptance, 50.0), open_gates)
    assert decision.prefer_passing(list(acceptance), lambda p: -predicted[p], failed) == ("2x1", "2x1")


def test_the_sweep_recommends_the_fastest_row_whose_verdict_is_enable():
    from specdec.eval.rows import recommend as _recommend

    def row(k, batch, speedup, failed):
        return {"num_draft_tokens": k, "batch_size": batch, "speedup": speedup, "decision": {"failed_gates": failed}}

    rows = [row(1, 1, 1.2, []), row(3, 1, 1.5, ["memory"]), row(2, 1, 1.3, ["acceptance_rate"]), row(2, 2, 1.15, [])]
    best, fastest = _recommend(rows, "speedup")
    assert (best["num_draft_tokens"], fastest["num_draft_tokens"]) == (1, 3)
    for r in rows:
        r["decision"]["failed_gates"] = ["speedup"]
    best, fastest = _recommend(rows, "speedup")
    assert best is fastest is rows[1]


def test_decision_fallback_and_threshold_validation():
    out = decision.decide(0.9, 2.0, True, 1.0, 50.0, fallback=True)
    assert out["verdict"] == "keep-target-only" and "fell back" in out["reasons"][-1]
    with pytest.raises(ValueError, match="min_acceptance_rate"):
        decision.Thresholds(min_acceptance_rate=1.5)
    assert decision.decide(0.3, 1.0, True, 0.0, 1.0, decision.Thresholds(0.2, 0.9, 0.0))["verdict"] == "enable"


def test_greedy_equivalence_lists_first_differing_position():
    out = equivalence.greedy_equivalence(["a", "b", "c"], [[1, 2, 3], [1, 2], [4]], [[1, 2, 3], [1, 5], [4, 2]])
    assert out["mode"] == "greedy" and out["checked"] == 3 and out["mismatches"] == 2 and not out["passed"]
    assert out["mismatched_prompts"][0] == {"prompt_id": "b", "position": 1, "baseline_token": 2, "speculative_token": 5}
    assert out["mismatched_prompts"][1]["position"] == 1 and out["mismatched_prompts"][1]["baseline_token"] is None
    assert equivalence.greedy_equivalence(["a"], [[1]], [[1]])["passed"]


def test_chi2_sf_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for x, dof in [(0.5, 1), (3.0, 2), (25.0, 10), (120.0, 99), (1e-6, 4)]:
        assert chi2_sf(x, dof) == pytest.approx(stats.chi2.sf(x, dof), rel=1e-6, abs=1e-12)
    assert chi2_sf(10.0, 0) == 1.0


def test_pool_cells_merges_small_expected_counts():
    e, o = pool_cells(torch.tensor([50.0, 30.0, 2.0, 1.0, 1.5]), torch.tensor([48.0, 33.0, 3.0, 0.0, 1.0]))
    # 2 + 1 + 1.5 = 4.5 is still < 5, so the pooled cell joins the smallest kept cell
    assert e.tolist() == [50.0, 34.5] and o.tolist() == [48.0, 37.0]
    e, o = pool_cells(torch.tensor([50.0, 3.0, 3.0]), torch.tensor([49.0, 4.0, 3.0]))
    assert e.tolist() == [50.0, 6.0] and o.tolist() == [49.0, 7.0]


def test_goodness_of_fit_accepts_the_truth_and_rejects_a_shifted_law():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = torch.multinomial(p, 4000, replacement=True, generator=g)
    good = goodness_of_fit(torch.bincount(draws, minlength=4), p)
    assert good["p_value"] > 1e-3 and good["tv"] <= good["tv_tolerance"] and good["dof"] == 3
    bad = goodness_of_fit(torch.bincount(draws, minlength=4), torch.tensor([0.4, 0.4, 0.15, 0.05]))
    assert bad["p_value"] < 1e-6
    impossible = goodness_of_fit(torch.tensor([10, 0, 0, 1]), torch.tensor([0.5, 0.3, 0.2, 0.0]))
    assert impossible["p_value"] == 0.0 and impossible["impossible_samples"] == 1
    other = torch.bincount(torch.multinomial(p, 4000, replacement=True, generator=g), minlength=4)
    assert homogeneity(torch.bincount(draws, minlength=4), other)["p_value"] > 1e-3


def test_tv_tolerance_shrinks_with_samples():
    p = torch.full((10,), 0.1)
    assert tv_tolerance(p, 100) > tv_tolerance(p, 10000)
    expected = 0.5 * 10 * math.sqrt(0.09 / 10000) + math.sqrt(math.log(1000) / 20000)
    assert tv_tolerance(p, 10000) == pytest.approx(expected)


class _DriftingClock:
    """A clock that only model forwards advance: a forward of n tokens costs its model's (base + per_token x n)
    units, times a slowdown that grows with every forward, as a shared machine's speed drifts."""

    def __init__(self, drift_per_call: float = 0.005):
        self.now, self.calls, self.drift = 0.0, 0, drift_per_call

    def __call__(self) -> float:
        return self.now

    def charge(self, model, base: float, per_token: float) -> None:
        def hook(_module, args, kwargs):
            tokens = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]
            self.calls += 1
            self.now += (base + per_token * tokens) * (1 + self.drift * self.calls)

        model.register_forward_pre_hook(hook, with_kwargs=True)


def test_measure_costs_interleaves_forwards_so_drift_hits_every_kind_alike():
    """Timed kind after kind, this simulated drift made v(5) 1.76 for a true 1.36 (on a shared VM real drift once
    made a longer verification look cheaper than a one-token step); interleaved, every ratio stays within 5% of
    the true one."""
    target, draft, clock = tiny_llama(seed=0), tiny_llama(seed=1, layers=1), _DriftingClock()
    clock.charge(target, base=10.0, per_token=1.0)
    clock.charge(draft, base=2.0, per_token=0.0)
    ks = [1, 2, 3, 4]
    costs = measure_costs(target, draft, torch.tensor([[3, 5, 7, 9, 11]]), ks, repeats=10, clock=clock)
    assert costs["c"] == pytest.approx(2.0 / 11.0, rel=0.05)
    for k in ks:
        assert costs["v"][str(k)] == pytest.approx((10.0 + k + 1) / 11.0, rel=0.05), k
