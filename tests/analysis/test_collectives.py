"""The communication cost model: the alpha-beta formulas, gloo's segmented ring and its fit to measured
all-reduce times, the
collectives one TP/PP step issues, and `explain --tp/--pp`'s account (pure functions, no processes)."""

import dataclasses
import json

import pytest

from servescope.analysis.collectives import (
    LINKS, LinkSpec, all_reduce_seconds, cached_local_link, gather_seconds, p2p_seconds, ring_steps, ring_terms,
    save_local_link, shard_config, step_comm_cost,
)
from servescope.analysis.link_fit import fit_link, fit_step_collectives
from servescope.analysis.hardware import get_hardware
from servescope.analysis.parallel_explain import explain_parallel
from servescope.analysis.presets import load_preset
from servescope.errors import InvalidParameterError

LINK = LinkSpec("test", bandwidth=1e9, latency_s=10e-6)


def test_ring_all_reduce_alpha_beta():
    # 2(N-1)/N x bytes / bw + 2(N-1) x latency
    assert all_reduce_seconds(1e6, 2, LINK) == pytest.approx(1e6 / 1e9 + 2 * 10e-6)
    assert all_reduce_seconds(8e6, 8, LINK) == pytest.approx(14 / 8 * 8e6 / 1e9 + 14 * 10e-6)
    assert all_reduce_seconds(1e6, 1, LINK) == 0.0
    assert gather_seconds(1e6, 4, LINK) == pytest.approx(3 * (1e6 / 1e9 + 10e-6))
    assert p2p_seconds(1e6, LINK) == pytest.approx(1e-3 + 10e-6)


def test_ring_steps_follow_gloo_segments():
    # gloo: S = roundUp(max(ceil(B / 1 MiB), 2N), N) segments, S - S/N steps per phase
    mib = 1 << 20
    assert [ring_steps(b, 2) for b in (8192, mib, 4 * mib)] == [2, 2, 2]  # 4 segments of B/4
    assert [ring_steps(b, 2) for b in (4 * mib + 4, 5 * mib, 8 * mib, 64 * mib)] == [3, 3, 4, 32]
    assert [ring_steps(b, 4) for b in (8192, 8 * mib, 9 * mib)] == [6, 6, 9]  # 8, 8, 12 segments
    assert ring_steps(64, 2, max_segment_bytes=16) == 2 and ring_steps(80, 2, max_segment_bytes=16) == 3


GLOO = LinkSpec("gloo", bandwidth=2e9, latency_s=340e-6, call_s=300e-6, step_s=40e-6, max_segment_bytes=1 << 20)


def test_gloo_ring_time_has_a_regime_change_at_2n_segments():
    mib = 1 << 20
    # up to 4 MiB (N = 2): one call, 4 steps, the bytes
    assert all_reduce_seconds(8192, 2, GLOO) == pytest.approx(300e-6 + 4 * 40e-6 + 8192 / 2e9)
    assert all_reduce_seconds(4 * mib, 2, GLOO) == pytest.approx(300e-6 + 4 * 40e-6 + 4 * mib / 2e9)
    # above: one step per MiB and phase
    assert all_reduce_seconds(64 * mib, 2, GLOO) == pytest.approx(300e-6 + 64 * 40e-6 + 64 * mib / 2e9)
    # other rank counts: the same terms, gloo's segments for N ranks, 2(N-1)/N of the bytes sent
    assert all_reduce_seconds(mib, 4, GLOO) == pytest.approx(300e-6 + 12 * 40e-6 + 1.5 * mib / 2e9)
    assert all_reduce_seconds(mib, 1, GLOO) == 0.0
    assert "per step" in GLOO.describe() and "per hop" in LINK.describe()


def test_fit_recovers_the_gloo_ring_terms_and_predicts_unprobed_sizes():
    probed = [8 * 1024 * 4 ** i for i in range(7)] + [64 << 20]
    measured = {b: all_reduce_seconds(b, 2, GLOO) for b in probed}
    link = fit_link(measured, ranks=2)
    assert link.call_s == pytest.approx(GLOO.call_s, rel=1e-6)
    assert link.step_s == pytest.approx(GLOO.step_s, rel=1e-6)
    assert link.bandwidth == pytest.approx(GLOO.bandwidth, rel=1e-6)
    assert link.latency_s == pytest.approx(link.call_s + link.step_s)  # p2p / gather: one call of one message
    for b in (16 * 1024, 3 << 20, 6 << 20, 48 << 20):  # never probed, both sides of the regime change
        assert all_reduce_seconds(b, 2, link) == pytest.approx(all_reduce_seconds(b, 2, GLOO), rel=1e-6)


BUFFERED = LinkSpec("gloo", bandwidth=1e9, latency_s=100e-6, step_s=100e-6, max_segment_bytes=1 << 20,
                    buffer_bytes=128 << 10, buffered_bandwidth=4e9)


def test_segment_bytes_past_the_socket_buffer_stream_at_the_other_rate():
    kib = 1024
    # 512 KiB at N = 2: 4 steps of 128 KiB, every byte into the buffer
    assert ring_terms(512 * kib, 2, 1 << 20, 128 * kib) == (1.0, 4.0, 512 * kib, 0.0)
    # 1 MiB: 4 steps of 256 KiB, half of each past the buffer
    assert ring_terms(1 << 20, 2, 1 << 20, 128 * kib) == (1.0, 4.0, 512 * kib, 512 * kib)
    assert all_reduce_seconds(512 * kib, 2, BUFFERED) == pytest.approx(4 * 100e-6 + 512 * kib / 4e9)
    assert all_reduce_seconds(1 << 20, 2, BUFFERED) == pytest.approx(4 * 100e-6 + 512 * kib / 4e9 + 512 * kib / 1e9)
    # no buffer modelled: every byte at `bandwidth` (the three-term ring)
    assert ring_terms(1 << 20, 2, 1 << 20) == (1.0, 4.0, 0.0, float(1 << 20))
    assert "128 KiB" in BUFFERED.describe()


def test_fit_recovers_the_buffered_ring_from_the_probe_sizes():
    probed = [8 * 1024 * 4 ** i for i in range(7)] + [64 << 20]
    truth = dataclasses.replace(BUFFERED, call_s=200e-6)
    link = fit_link({b: all_reduce_seconds(b, 2, truth) for b in probed}, ranks=2, buffer_bytes=128 << 10)
    for field in ("call_s", "step_s", "bandwidth", "buffered_bandwidth"):
        assert getattr(link, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    for b in (16 * 1024, 256 * 1024, 1 << 20, 3 << 20, 48 << 20):
        assert all_reduce_seconds(b, 2, link) == pytest.approx(all_reduce_seconds(b, 2, truth), rel=1e-6)


def test_fit_keeps_every_term_non_negative():
    # a pure straight line with a fixed cost: no per-step term to find; noise must not make one negative
    sizes = [8 * 1024 * 4 ** i for i in range(7)] + [64 << 20]
    line = {b: (1e-3 + b / 1e9) * (1 + (0.02 if i % 2 else -0.02)) for i, b in enumerate(sizes)}
    link = fit_link(line, ranks=2)
    assert link.call_s >= 0 and link.step_s >= 0 and link.bandwidth > 0
    for b, t in line.items():
        assert all_reduce_seconds(b, 2, link) == pytest.approx(t, rel=0.1)
    # times falling with size: the fitted per-byte cost would be negative, which is refused
    falling = {b: 2e-3 - i * 1e-4 for i, b in enumerate(sizes)}
    with pytest.raises(InvalidParameterError, match="do not grow"):
        fit_link(falling, 2)


def test_fit_rejects_times_that_do_not_grow():
    with pytest.raises(InvalidParameterError, match="two sizes"):
        fit_link({1024: 1e-3}, 2)
    with pytest.raises(InvalidParameterError, match="do not grow"):
        fit_link({1024: 2e-3, 1 << 20: 1e-3}, 2)


def test_link_rejects_negative_terms():
    with pytest.raises(InvalidParameterError):
        LinkSpec("bad", 1e9, 1e-6, step_s=-1e-6)


def test_local_link_cache_round_trip(tmp_path):
    link = fit_link({8192: 1e-4, 1 << 20: 1e-3, 1 << 24: 2e-2}, 2)
    path = tmp_path / "link.json"
    save_local_link("cpu A", link, path)
    assert cached_local_link("cpu A", path) == link
    assert cached_local_link("cpu B", path) is None
    assert "cpu A" in json.loads(path.read_text())
    # the step's other collectives ride in the same entry
    both = fit_step_collectives({"all_to_all": {0: 2e-4, 1 << 20: 1.2e-3}, "all_gather": {8: 3e-4, 1 << 20: 1.3e-3},
                                 "plan": {80: 5e-4}}, link)
    save_local_link("cpu A", both, path)
    assert cached_local_link("cpu A", path) == both and both.a2a_bandwidth > 0 and both.ag_bandwidth > 0
    # an entry of the all-reduce alone (before those were measured) reads back without them
    measured_apart = ("a2a", "ag_", "plan")
    entry = {k: v for k, v in json.loads(path.read_text())["cpu A"].items() if not k.startswith(measured_apart)}
    path.write_text(json.dumps({"cpu A": entry}))
    assert cached_local_link("cpu A", path) == link
    # an entry written by an older model (its measured table) is measured again, not misread
    path.write_text(json.dumps({"cpu A": {"name": "local-gloo", "bandwidth": 1e9, "latency_s": 1e-4,
                                          "all_reduce_table": [[8192, 1e-4]], "table_ranks": 2}}))
    assert cached_local_link("cpu A", path) is None


def test_step_comm_counts_the_collectives_of_a_tp_and_a_pp_step():
    cfg = load_preset("llama-3-8b")
    t, b = 64, 4
    act = t * cfg.hidden_size * 2
    tp = step_comm_cost(cfg, t, b, tp=4, pp=1, link=LINK, act_bytes=2)
    # two all-reduces per layer and one after the vocabulary-parallel embedding
    assert tp.all_reduce_seconds == pytest.approx((2 * cfg.num_hidden_layers + 1) * all_reduce_seconds(act, 4, LINK))
    assert tp.gather_seconds == pytest.approx(gather_seconds(b * (cfg.vocab_size // 4) * 4, 4, LINK))
    assert tp.p2p_seconds == 0
    pp = step_comm_cost(cfg, t, b, tp=1, pp=4, link=LINK, act_bytes=2)
    assert pp.all_reduce_seconds == 0 and pp.gather_seconds == 0
    # (h, residual) from each stage to the next, the logits back to rank 0
    assert pp.p2p_seconds == pytest.approx(3 * p2p_seconds(2 * act, LINK) + p2p_seconds(b * cfg.vocab_size * 4, LINK))
    assert step_comm_cost(cfg, 0, 0, 4, 1, LINK).seconds == 0


def test_shard_config_divides_heads_mlp_vocab():
    cfg = load_preset("llama-3-70b")
    s = shard_config(cfg, 8)
    assert (s.num_attention_heads, s.num_key_value_heads, s.intermediate_size) == (8, 1, cfg.intermediate_size // 8)
    assert s.vocab_size == -(-cfg.vocab_size // 8) and s.num_hidden_layers == cfg.num_hidden_layers


def test_explain_parallel_nvlink_cuts_70b_decode_pcie_link_dominates():
    cfg = load_preset("llama-3-70b")
    nv = explain_parallel(cfg, get_hardware("h100"), LINKS["nvlink4"], 8, 1, batch=1)
    dec = nv["phases"][1]
    assert dec["name"] == "decode" and dec["speedup"] > 4 and not dec["link_dominates"]
    assert dec["step_seconds"] == pytest.approx(dec["compute_seconds"] + dec["comm_seconds"])
    assert "cuts the step" in nv["verdict"]
    # 70B bf16 (~141 GB) does not fit one 80 GB H100; at TP=8 each rank holds ~18 GB and room for KV
    assert nv["max_concurrent_sequences_one_device"] == 0 and nv["max_concurrent_sequences"] > 8
    # per rank: 1/8 of the (sharded) weights and one of 8 KV heads
    assert nv["weight_bytes_per_rank"] < 0.14 * explain_parallel(cfg, get_hardware("h100"), LINKS["nvlink4"], 1, 1)[
        "weight_bytes_per_rank"]
    slow = explain_parallel(cfg, get_hardware("h100"), LinkSpec("slow", 1e9, 100e-6), 8, 1, batch=1)
    assert slow["phases"][1]["link_dominates"] and "the link dominates" in slow["verdict"]
    pp = explain_parallel(cfg, get_hardware("h100"), LINKS["nvlink4"], 1, 4, batch=1)
    assert pp["phases"][1]["speedup"] < 1  # stages in sequence: PP buys memory, not time
    assert pp["weight_bytes_per_rank"] == pytest.approx(nv["weight_bytes_per_rank"] * 8 / 4, rel=0.05)
    with pytest.raises(InvalidParameterError, match="must divide"):
        explain_parallel(cfg, get_hardware("h100"), LINKS["nvlink4"], 3, 1)


def test_explain_parallel_on_one_cpu_shares_the_machine():
    """On a CPU spec the T ranks share the cores and bandwidth: TP cannot cut the step there."""
    from servescope.analysis.spec import HardwareSpec

    cpu = HardwareSpec(name="cpu", kind="cpu", peak_flops={d: 1e11 for d in ("float32", "bfloat16", "float16", "int8")},
                       memory_bandwidth=2e10, memory_bytes=1 << 34)
    r = explain_parallel(load_preset("llama-3-8b"), cpu, LINK, 2, 1, batch=1, weight_dtype="float32")
    for p in r["phases"]:
        assert p["speedup"] < 1.05 and p["step_seconds"] > p["single_device_seconds"] * 0.95


def test_the_ranks_spread_on_equal_work_is_fitted_robustly():
    """link_fit.relative_spread: each round's variance over its chi-square median, so that it reads the sd of one
    rank's time on Gaussian samples and a round in which one rank lost its core moves it little."""
    import random

    from servescope.analysis.link_fit import relative_spread

    rng = random.Random(0)
    for ranks in (2, 4):
        rounds = [[rng.gauss(5e-3, 5e-4) for _ in range(ranks)] for _ in range(4000)]
        assert relative_spread(rounds) == pytest.approx(0.1, rel=0.05)
    rounds = [[rng.gauss(5e-3, 5e-4), rng.gauss(5e-3, 5e-4)] for _ in range(24)]
    slow = rounds[:-2] + [[5e-3, 5e-2], [5e-2, 5e-3]]  # two rounds of 24 with one rank stalled 10x
    assert relative_spread(slow) < 2 * relative_spread(rounds) + 0.05
    assert relative_spread([[1.0], [2.0]]) == 0.0 and relative_spread([]) == 0.0
    for bad in ([[1.0, 0.0]], [[1.0, 2.0], [1.0, 2.0, 3.0]]):
        with pytest.raises(InvalidParameterError):
            relative_spread(bad)
    # the probe's figure rides on the link (0 where it was not measured); a negative one is refused
    base = fit_link({8192: 1e-4, 1 << 20: 1e-3, 1 << 24: 2e-2}, ranks=2)
    step = {"all_to_all": {0: 2e-4, 1 << 20: 1.2e-3}, "all_gather": {8: 3e-4, 1 << 20: 1.3e-3}, "plan": {80: 5e-4}}
    assert fit_step_collectives(step, base).desync == 0.0
    assert fit_step_collectives({**step, "desync": {1 << 25: 0.07}}, base).desync == 0.07
    with pytest.raises(InvalidParameterError):
        LinkSpec("x", 1e9, 1e-6, desync=-0.1)
