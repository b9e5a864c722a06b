"""The communication cost model: the alpha-beta formulas, the fit to measured all-reduce times, the
collectives one TP/PP step issues, and `explain --tp/--pp`'s account (pure functions, no processes)."""

import json

import pytest

from servescope.analysis.collectives import (
    LINKS, LinkSpec, all_reduce_seconds, cached_local_link, fit_link, gather_seconds, p2p_seconds, save_local_link,
    shard_config, step_comm_cost,
)
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


def test_fit_recovers_a_straight_line_and_keeps_the_table():
    true = LinkSpec("x", bandwidth=2e9, latency_s=50e-6)
    sizes = [8 * 1024 * 4 ** i for i in range(7)]
    measured = {b: 2 * 50e-6 + b / 2e9 for b in sizes}  # 2 ranks: 2 hops, 2(N-1)/N = 1
    link = fit_link(measured, ranks=2)
    assert link.bandwidth == pytest.approx(true.bandwidth, rel=1e-9)
    assert link.latency_s == pytest.approx(true.latency_s, rel=1e-9)
    # at the measured rank count the table itself answers, between sizes by log-log interpolation
    for b in sizes:
        assert all_reduce_seconds(b, 2, link) == pytest.approx(measured[b])
    mid = 2 * sizes[2]
    assert measured[sizes[2]] < all_reduce_seconds(mid, 2, link) < measured[sizes[3]]
    # past the largest size: that size's bandwidth; other rank counts: the fitted alpha-beta line
    assert all_reduce_seconds(4 * sizes[-1], 2, link) == pytest.approx(4 * measured[sizes[-1]])
    assert all_reduce_seconds(1e6, 4, link) == pytest.approx(1.5 * 1e6 / 2e9 + 6 * 50e-6)


def test_fit_rejects_times_that_do_not_grow():
    with pytest.raises(InvalidParameterError, match="two sizes"):
        fit_link({1024: 1e-3}, 2)
    with pytest.raises(InvalidParameterError, match="do not grow"):
        fit_link({1024: 2e-3, 1 << 20: 1e-3}, 2)


def test_local_link_cache_round_trip(tmp_path):
    link = fit_link({8192: 1e-4, 1 << 20: 1e-3, 1 << 24: 2e-2}, 2)
    path = tmp_path / "link.json"
    save_local_link("cpu A", link, path)
    assert cached_local_link("cpu A", path) == link
    assert cached_local_link("cpu B", path) is None
    assert "cpu A" in json.loads(path.read_text())


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
