"""The wait for the busiest expert-parallel rank (analysis/parallel_skew.py): the busiest rank's load under
uniform routing against exact and sampled counts, nothing to wait for when routing is balanced, and the wait
priced by the cost model at that load."""

import dataclasses
import math
import random

import pytest

from servescope.analysis.collectives import LINKS, shard_config, step_comm_cost
from servescope.analysis.hardware import get_hardware
from servescope.analysis.parallel_skew import busiest_rank_load, expected_max_normal, expert_wait_seconds
from servescope.analysis.presets import load_preset
from servescope.analysis.step_prediction import StepPredictor
from servescope.errors import InvalidParameterError

DTYPES = ("bfloat16", "bfloat16", "bfloat16")


def test_expected_max_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)  # E|Z| / sqrt(2)
    assert expected_max_normal(4) == pytest.approx(1.02938, rel=1e-4)
    assert expected_max_normal(2) < expected_max_normal(3) < expected_max_normal(8)
    with pytest.raises(InvalidParameterError):
        expected_max_normal(0)


def test_one_decode_token_against_the_exact_hypergeometric():
    """One token's k = 8 experts of 32 over two ranks of 16: the busier rank's count, max(X, 8 - X)."""
    e, k = 32, 8
    exact = sum(max(x, k - x) * math.comb(16, x) * math.comb(16, k - x) for x in range(k + 1)) / math.comb(e, k)
    (rows, rows_max), (distinct, distinct_max) = busiest_rank_load(e, k, 1, 2)
    assert rows == distinct == 4.0
    assert rows_max == pytest.approx(exact, rel=0.02) and distinct_max == pytest.approx(exact, rel=0.02)


def test_a_few_tokens_against_sampled_routing():
    rng = random.Random(0)
    e, k, t, n, trials = 32, 8, 4, 2, 4000
    rows_max = distinct_max = 0
    for _ in range(trials):
        counts = [0] * e
        for _ in range(t):
            for x in rng.sample(range(e), k):
                counts[x] += 1
        per = [counts[r * e // n:(r + 1) * e // n] for r in range(n)]
        rows_max += max(sum(c) for c in per)
        distinct_max += max(sum(1 for x in c if x) for c in per)
    (_, rows_hi), (distinct, distinct_hi) = busiest_rank_load(e, k, t, n)
    assert rows_hi == pytest.approx(rows_max / trials, rel=0.02)
    assert distinct_hi == pytest.approx(distinct_max / trials, rel=0.02)
    assert distinct == pytest.approx(e / n * (1 - (1 - k / e) ** t))


def test_balanced_routing_waits_for_nothing():
    # every token picks every expert: each rank runs E/N rows per token over all its experts
    (rows, rows_max), (distinct, distinct_max) = busiest_rank_load(8, 8, 5, 2)
    assert rows_max == rows == 20 and distinct_max == distinct == 4
    cfg = load_preset("mixtral-8x7b")
    balanced = dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, experts=dataclasses.replace(cfg.moe.experts, top_k=8)))
    hw = get_hardware("h100")
    assert expert_wait_seconds(balanced, [(1, 64)] * 4, hw, DTYPES, 2) == 0.0
    assert expert_wait_seconds(cfg, [(1, 64)] * 4, hw, DTYPES, 1) == 0.0  # one rank
    assert expert_wait_seconds(load_preset("llama-3-8b"), [(1, 64)] * 4, hw, DTYPES, 2) == 0.0  # dense
    assert expert_wait_seconds(cfg, [], hw, DTYPES, 2) == 0.0


def test_the_busiest_rank_is_relatively_busier_with_more_ranks_and_less_so_with_more_tokens():
    ratio = {n: busiest_rank_load(64, 8, 16, n)[0] for n in (2, 4, 8)}
    assert ratio[2][1] / ratio[2][0] < ratio[4][1] / ratio[4][0] < ratio[8][1] / ratio[8][0]
    few, many = busiest_rank_load(64, 8, 4, 2)[0], busiest_rank_load(64, 8, 1024, 2)[0]
    assert few[1] / few[0] > many[1] / many[0] > 1.0
    with pytest.raises(InvalidParameterError):
        busiest_rank_load(30, 8, 4, 4)  # 4 ranks do not split 30 experts


def test_the_wait_is_the_cost_model_at_the_busiest_load_and_the_predictor_adds_it():
    cfg, hw = load_preset("qwen3-30b-a3b"), get_hardware("h100")
    seqs = [(1, 256)] * 4
    shard = shard_config(cfg, 1, 2)
    wait = expert_wait_seconds(shard, seqs, hw, DTYPES, 2)
    assert wait > 0
    mean = StepPredictor(cfg, hw, DTYPES + (2,), ep=2).predict(seqs, 4)
    # a decode step reads its experts' weights: the wait is about the busier rank's extra distinct experts
    (_, _), (distinct, distinct_max) = busiest_rank_load(128, 8, 4, 2)
    mlp = next(o for o in mean.cost.ops if o.name == "mlp")
    expert_bytes = 3 * cfg.hidden_size * cfg.moe.experts.intermediate_size * 2
    extra = cfg.moe.num_sparse(cfg.num_hidden_layers) * (distinct_max - distinct) * expert_bytes
    assert mlp.memory_seconds >= mlp.compute_seconds
    assert wait == pytest.approx(extra / hw.memory_bandwidth, rel=0.02)
    assert mean.wait_seconds == pytest.approx(wait) and mean.comm_seconds is None
    assert mean.seconds == pytest.approx(mean.cost.predicted_seconds + wait)
    linked = StepPredictor(cfg, hw, DTYPES + (2,), link=LINKS["nvlink4"], ep=2).predict(seqs, 4)
    comm = step_comm_cost(cfg, 4, 4, 1, 1, LINKS["nvlink4"], 2, ep=2)
    assert linked.comm_seconds == pytest.approx(comm.seconds + wait)
    assert linked.all_to_all_seconds == pytest.approx(comm.all_to_all_seconds)
    # measured routing: the mean from it, the spread uniform routing's
    measured = expert_wait_seconds(shard, seqs, hw, DTYPES, 2, distinct_experts=20.0)
    assert 0 < measured <= wait * 1.5


def test_the_ranks_spread_on_equal_work_adds_to_the_wait():
    """LinkSpec.desync: each sync after t seconds of a rank's work waits e_N desync t more, the experts' segment
    added as a variance to the routing's skew; 0 leaves the routing's wait alone."""
    from servescope.analysis.cost_model import step_cost

    cfg, hw = load_preset("qwen3-30b-a3b"), get_hardware("h100")
    seqs, shard = [(1, 256)] * 4, shard_config(cfg, 1, 2)
    load = expert_wait_seconds(shard, seqs, hw, DTYPES, 2)
    assert expert_wait_seconds(shard, seqs, hw, DTYPES, 2, desync=0.0) == load
    ops = {o.name: o.seconds for o in step_cost(shard, seqs, hw, *DTYPES, expert_parallel=2).ops}
    rest = sum(t for name, t in ops.items() if name not in ("mlp", "lm_head", "embedding"))
    spread = expected_max_normal(2) * 0.1
    wait = expert_wait_seconds(shard, seqs, hw, DTYPES, 2, desync=0.1)
    assert wait == pytest.approx(math.hypot(load, spread * ops["mlp"]) + spread * rest, rel=1e-9)
    assert load < wait < expert_wait_seconds(shard, seqs, hw, DTYPES, 2, desync=0.2)
    # the predictor takes it from its link, and so does explain's phase
    link = dataclasses.replace(LINKS["nvlink4"], desync=0.1)
    linked = StepPredictor(cfg, hw, DTYPES + (2,), link=link, ep=2).predict(seqs, 4)
    assert linked.wait_seconds == pytest.approx(wait)
    assert linked.comm_seconds == pytest.approx(step_comm_cost(cfg, 4, 4, 1, 1, link, 2, ep=2).seconds + wait)
    assert expert_wait_seconds(cfg, seqs, hw, DTYPES, 1, desync=0.1) == 0.0  # one rank waits for nobody
