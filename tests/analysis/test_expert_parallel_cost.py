"""What expert parallelism costs in the model (pure functions): a rank's share of the routed experts, the
all-to-alls and all-gathers per sparse layer, the all-reduces it leaves out, and `explain --ep`."""

import dataclasses

import pytest

from servescope.analysis.collectives import (LINKS, LinkSpec, all_reduce_seconds, expert_parallel_cost, shard_config,
                                             step_comm_cost)
from servescope.analysis.cost_model import step_cost
from servescope.analysis.hardware import get_hardware
from servescope.analysis.op_counts import mlp_counts
from servescope.analysis.parallel_explain import explain_parallel
from servescope.analysis.presets import load_preset
from servescope.errors import InvalidParameterError

LINK = LinkSpec("test", bandwidth=1e9, latency_s=10e-6)


def test_a_rank_runs_one_nth_of_the_routed_experts_rows_and_reads_one_nth_of_them():
    cfg = load_preset("qwen3-30b-a3b")  # every layer sparse, no shared expert
    e, d, L = cfg.moe.experts, cfg.hidden_size, cfg.num_hidden_layers
    one, four = mlp_counts(cfg, 64, "bfloat16", "bfloat16", 40.0), mlp_counts(cfg, 64, "bfloat16", "bfloat16", 40.0, 4)
    routed_flops = L * 2 * 64 * d * e.top_k * 3 * e.intermediate_size
    assert one[0] - four[0] == pytest.approx(routed_flops * 3 / 4, rel=1e-9)
    expert_bytes = 3 * d * e.intermediate_size * 2  # bfloat16
    assert one[2] - four[2] == pytest.approx(L * 40.0 * expert_bytes * 3 / 4, rel=1e-6)
    hw = get_hardware("h100")
    assert step_cost(cfg, [(1, 512)] * 64, hw, expert_parallel=4).predicted_seconds < \
        step_cost(cfg, [(1, 512)] * 64, hw).predicted_seconds


def test_all_to_alls_and_gathers_per_sparse_layer():
    cfg = load_preset("mixtral-8x7b")  # 32 sparse layers, k = 2 of 8
    d, layers = cfg.hidden_size, 32
    a2a, gathers, sent = expert_parallel_cost(cfg, 10, 2, LINK, act_bytes=2)
    slice_bytes = 5 * d * 2  # ceil(10 / 2) tokens
    # dispatch and combine: k rows per token, half of them to the other rank
    assert a2a == pytest.approx(layers * 2 * (slice_bytes * 2 / 2 / 1e9 + 10e-6))
    assert gathers == pytest.approx(layers * ((8 * 8 / 1e9 + 10e-6) + (slice_bytes / 1e9 + 10e-6)))
    assert sent == pytest.approx(layers * (2 * slice_bytes + 8 * 8 + slice_bytes))
    assert expert_parallel_cost(cfg, 10, 1, LINK) == (0.0, 0.0, 0.0)
    assert expert_parallel_cost(load_preset("llama-3-8b"), 10, 2, LINK) == (0.0, 0.0, 0.0)


def test_tp_with_ep_all_reduces_after_attention_and_shared_experts_only():
    cfg = load_preset("mixtral-8x7b")  # no shared expert: one all-reduce per layer, one for the embedding
    act = 16 * cfg.hidden_size * 2
    ep = step_comm_cost(cfg, 16, 16, 2, 1, LINK, 2, ep=2)
    assert ep.all_reduce_seconds == pytest.approx((cfg.num_hidden_layers + 1) * all_reduce_seconds(act, 2, LINK))
    assert ep.all_to_all_seconds > 0
    assert ep.seconds == pytest.approx(ep.all_reduce_seconds + ep.gather_seconds + ep.all_to_all_seconds
                                       + ep.plan_seconds)
    qwen = load_preset("qwen1.5-moe-a2.7b")  # a shared expert in every sparse layer: its all-reduce stays
    act = 16 * qwen.hidden_size * 2
    shared = step_comm_cost(qwen, 16, 16, 2, 1, LINK, 2, ep=2)
    reduces = 2 * qwen.num_hidden_layers + 1
    assert shared.all_reduce_seconds == pytest.approx(reduces * all_reduce_seconds(act, 2, LINK))
    replicated = step_comm_cost(cfg, 16, 16, 1, 1, LINK, 2, ep=2)  # EP over replicated attention: no all-reduce
    assert replicated.all_reduce_seconds == 0 and replicated.all_to_all_seconds == ep.all_to_all_seconds


def test_explain_shows_expert_parallelism_for_moe_presets():
    cfg, hw = load_preset("qwen3-30b-a3b"), get_hardware("h100")
    r = explain_parallel(cfg, hw, LINKS["nvlink4"], 4, 1, batch=16, ep=4)
    assert r["ep"] == 4 and "with EP=4" in r["verdict"]
    assert all(p["all_to_all_seconds"] > 0 for p in r["phases"])
    one = explain_parallel(cfg, hw, LINKS["nvlink4"], 1, 1, batch=16, ep=4)  # replicated attention
    assert r["weight_bytes_per_rank"] < one["weight_bytes_per_rank"] < 0.5 * cfg.num_parameters() * 2
    for tp, pp, ep, message in ((1, 1, 3, "does not divide the 128 experts"), (4, 1, 2, "needs EP = TP")):
        with pytest.raises(InvalidParameterError, match=message):
            explain_parallel(cfg, hw, LINKS["nvlink4"], tp, pp, ep=ep)
    odd = dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, experts=dataclasses.replace(cfg.moe.experts, intermediate_size=766)))
    with pytest.raises(InvalidParameterError, match="does not divide the experts' width 766"):
        explain_parallel(odd, hw, LINKS["nvlink4"], 4, 1)
    with pytest.raises(InvalidParameterError, match="no experts"):
        explain_parallel(load_preset("llama-3-8b"), hw, LINKS["nvlink4"], 1, 1, ep=2)


def test_step_prediction_adds_the_expert_parallel_collectives_at_tp_1():
    from servescope.analysis.step_prediction import StepPredictor

    cfg, hw = load_preset("mixtral-8x7b"), get_hardware("h100")
    dtypes = ("bfloat16", "bfloat16", "bfloat16", 2)
    seqs = [(1, 256)] * 8
    alone = StepPredictor(cfg, hw, dtypes).predict(seqs, 8)
    ep = StepPredictor(cfg, hw, dtypes, link=LINKS["nvlink4"], ep=2).predict(seqs, 8)
    want = step_comm_cost(cfg, 8, 8, 1, 1, LINKS["nvlink4"], 2, ep=2)
    # the collectives, and inside them the wait for the busier rank's experts (analysis/parallel_skew.py)
    assert ep.wait_seconds > 0 and want.all_to_all_seconds > 0
    assert ep.comm_seconds == pytest.approx(want.seconds + ep.wait_seconds)
    assert ep.cost.predicted_seconds < alone.cost.predicted_seconds  # half the routed experts' rows and weights
    assert ep.seconds == pytest.approx(ep.cost.predicted_seconds + ep.comm_seconds)


def test_the_step_collectives_are_priced_from_their_own_fits():
    """The local link's all-to-all and all-gather, fitted to their times as a step issues them: a call + bytes at
    each one's rate, instead of the all-reduce fit's latency and bandwidth; a datasheet link keeps pairwise
    exchange and the ring."""
    from servescope.analysis.collectives import all_gather_seconds, all_to_all_seconds
    from servescope.analysis.link_fit import fit_step_collectives

    ring = LinkSpec("local-gloo", bandwidth=2e9, latency_s=2e-4, call_s=1.5e-4, step_s=5e-5,
                    max_segment_bytes=1 << 20)
    a2a = {b: 300e-6 + b / 1.5e9 for b in (0, 4096, 65536, 1 << 20, 16 << 20)}
    ag = {b: 700e-6 + b / 1e9 for b in (512, 4096, 65536, 1 << 20)}
    link = fit_step_collectives({"all_to_all": a2a, "all_gather": ag, "plan": {80: 900e-6}}, ring)
    assert link.a2a_call_s == pytest.approx(300e-6, rel=1e-6) and link.a2a_bandwidth == pytest.approx(1.5e9)
    assert link.ag_call_s == pytest.approx(700e-6, rel=1e-6) and link.ag_bandwidth == pytest.approx(1e9)
    assert link.call_s == ring.call_s and "all-to-all 300 us per call" in link.describe()
    assert "all-gather 700 us" in link.describe()
    for b, t in a2a.items():
        assert all_to_all_seconds(b, 2, link) == pytest.approx(t)
    sizes = [0, 1024, 1 << 20, 1 << 24]
    for lk in (link, LINK):  # monotone in bytes, and not falling with more ranks
        assert all(all_to_all_seconds(a, 2, lk) < all_to_all_seconds(b, 2, lk) for a, b in zip(sizes, sizes[1:]))
        assert all_to_all_seconds(4096, 2, lk) <= all_to_all_seconds(4096, 4, lk) <= all_to_all_seconds(4096, 8, lk)
        assert all_to_all_seconds(4096, 1, lk) == 0.0
    assert all_to_all_seconds(4096, 4, LINK) == pytest.approx(4096 / 1e9 + 3 * 10e-6)  # pairwise, 3 messages
    # an all-gather's ring steps: each one exchange as the all-gather measured it (at N = 2, the one step)
    for b, t in ag.items():
        assert all_gather_seconds(b, 2, link) == pytest.approx(t)
    assert all_gather_seconds(4096, 4, link) == pytest.approx(3 * all_gather_seconds(4096, 2, link))
    assert all_gather_seconds(4096, 2, LINK) == pytest.approx(4096 / 1e9 + 10e-6)
    mixtral = load_preset("mixtral-8x7b")
    assert expert_parallel_cost(mixtral, 10, 2, link)[0] > expert_parallel_cost(mixtral, 10, 2, ring)[0]
    assert expert_parallel_cost(mixtral, 10, 2, link)[1] > expert_parallel_cost(mixtral, 10, 2, ring)[1]
    # a fit that would make the call negative keeps the bytes alone; times that do not grow are refused
    flat = fit_step_collectives({"all_to_all": {4096: 1e-6, 1 << 20: 1e-3}, "all_gather": ag, "plan": {80: 1e-3}},
                                ring)
    assert flat.a2a_call_s >= 0 and flat.a2a_bandwidth > 0
    for bad in ({4096: 1e-4}, {4096: 1e-3, 1 << 20: 1e-4}):
        with pytest.raises(InvalidParameterError):
            fit_step_collectives({"all_to_all": bad, "all_gather": ag, "plan": {80: 1e-3}}, ring)
    with pytest.raises(InvalidParameterError, match="plan"):
        fit_step_collectives({"all_to_all": a2a, "all_gather": ag}, ring)


def test_every_parallel_step_pays_the_plan_broadcasts():
    """Rank 0 broadcasts each step's plan (a header, then the payload: 3 int64 per token, 3 per sampled row, one
    more) before any rank computes: on a measured link plan_s + the bytes at its all-to-all's rate; on a datasheet
    link two broadcasts of a binomial tree; in every parallel step's collectives, TP, EP or PP."""
    from servescope.analysis.collectives import plan_bytes, plan_seconds
    from servescope.analysis.step_prediction import StepPredictor

    assert plan_bytes(1, 1) == 8 * (9 + 3 + 3 + 1)  # a one-token decode step: the header and 10 payload ints
    assert plan_bytes(16, 4) == plan_bytes(1, 1) + 8 * (3 * 15 + 3 * 3)
    measured = LinkSpec("local-gloo", bandwidth=2e9, latency_s=2e-4, a2a_call_s=3e-4, a2a_bandwidth=1e9,
                        ag_call_s=4e-4, ag_bandwidth=1e9, plan_s=8e-4)
    assert plan_seconds(1000, 2, measured) == pytest.approx(8e-4 + 1000 / 1e9)
    assert plan_seconds(1000, 4, measured) == pytest.approx(8e-4 + 3 * 1000 / 1e9)  # a send per other rank
    assert plan_seconds(1000, 2, LINK) == pytest.approx(2 * 10e-6 + 1000 / 1e9)
    assert plan_seconds(1000, 8, LINK) == pytest.approx(3 * (2 * 10e-6 + 1000 / 1e9))  # three hops of the tree
    assert plan_seconds(1000, 1, measured) == 0.0
    cfg, hw = load_preset("mixtral-8x7b"), get_hardware("h100")
    for tp, pp, ep in ((2, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1)):
        comm = step_comm_cost(cfg, 8, 8, tp, pp, measured, 2, ep)
        assert comm.plan_seconds == pytest.approx(plan_seconds(plan_bytes(8, 8), max(tp, ep) * pp, measured))
        assert comm.seconds == pytest.approx(comm.all_reduce_seconds + comm.gather_seconds + comm.p2p_seconds
                                             + comm.all_to_all_seconds + comm.plan_seconds)
    dtypes = ("bfloat16", "bfloat16", "bfloat16", 2)
    seqs = [(1, 256)] * 8
    for pp, ep in ((1, 2), (2, 1)):  # the EP step and the pipeline's schedule both start with the plan
        with_plan = StepPredictor(cfg, hw, dtypes, pp=pp, link=measured, ep=ep).predict(seqs, 8)
        assert with_plan.plan_seconds == pytest.approx(plan_seconds(plan_bytes(8, 8), 2, measured))
        tree = StepPredictor(cfg, hw, dtypes, pp=pp, link=dataclasses.replace(measured, plan_s=0.0), ep=ep)
        no_plan = tree.predict(seqs, 8)  # (the plan as a datasheet link's broadcasts, every other term the same)
        assert with_plan.seconds - no_plan.seconds == pytest.approx(with_plan.plan_seconds - no_plan.plan_seconds)
        b = plan_bytes(8, 8)
        assert with_plan.comm_seconds - no_plan.comm_seconds == pytest.approx(8e-4 + b / 1e9 - (2 * 2e-4 + b / 2e9))
    assert StepPredictor(cfg, hw, dtypes).predict(seqs, 8).plan_seconds == 0.0  # one process: no plan sent


def test_tensor_parallel_inside_each_expert_and_expert_parallel_stages_are_priced():
    """TP without EP shards each expert's width (the rank reads 1/T of every active expert, no all-to-all, one
    all-reduce per layer after the MLP); EP inside pipeline stages adds each stage's all-to-alls."""
    cfg, hw = load_preset("qwen3-30b-a3b"), get_hardware("h100")
    e = cfg.moe.experts
    inside, split = shard_config(cfg, 4), shard_config(cfg, 4, ep=4)
    assert inside.moe.experts.intermediate_size == e.intermediate_size // 4
    assert split.moe.experts.intermediate_size == e.intermediate_size  # (split whole over the ranks instead)
    r = explain_parallel(cfg, hw, LINKS["nvlink4"], 4, 1, batch=16)
    assert r["ep"] == 1 and all(p["all_to_all_seconds"] == 0 and p["all_reduce_seconds"] > 0 for p in r["phases"])
    assert r["weight_bytes_per_rank"] < 0.3 * cfg.num_parameters() * 2
    staged = explain_parallel(cfg, hw, LINKS["nvlink4"], 2, 2, batch=16, ep=2)
    flat = explain_parallel(cfg, hw, LINKS["nvlink4"], 2, 2, batch=16)
    assert staged["phases"][1]["comm_seconds"] > flat["phases"][1]["comm_seconds"]  # the stages' all-to-alls
