"""Every lab end to end in --quick mode on a tiny random model: it writes its plots, report and
results.json, and its numbers show the effect the lab exists to show.

The assertions are of two kinds. Counted quantities (FLOPs, bytes, tokens and blocks of a step, from
the StepRecords and the cost model on a datasheet spec) are exact or nearly so. Timings are taken on
a 2-core machine shared with other work: they are ratios of medians over interleaved repeats (the
labs' quick mode), with margins of about 1.5x below the smallest value seen here in repeated runs
under load (the "here" figures below), never absolute times. Each would fail if the mechanism the
lab shows were off: no batching, no KV cache, no chunking, a cost model of another machine.
"""

import json
import math

import pytest
import torch

from servescope.measure.local_hardware import probe_local_cpu
from servescope.labs import all_labs, run_lab
from servescope.labs.common import LabOptions, LabSession

# Random weights (no checkpoint, no tokenizer: the labs feed token ids). Wide enough that a prefill of a
# few hundred tokens costs many decode steps, with a vocabulary small enough that the LM head does not
# dominate the weights: 2 layers, 8 MiB of float32 weights.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
        "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 2048, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
SPEC = "A100-80GB"  # a datasheet spec: exact cost-model labels, no CPU probe


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("model") / "config.json"
    cfg.write_text(json.dumps(TINY))
    opts = LabOptions(out=tmp_path_factory.mktemp("out"), quick=True, model=f"random:{cfg}", threads=1, hardware=SPEC)
    session = LabSession(opts)
    # load the weights with the longest context first: a random model's rotary table covers the
    # max_model_len of the engine that loaded it, and the labs' engines share those weights
    session.engine(max_model_len=TINY["max_position_embeddings"], num_kv_blocks=80)
    return session


def run_quick(name, session, tmp_path, hardware=SPEC) -> dict:
    """Run lab `name` in quick mode, check the files it writes, return its summary."""
    opts = LabOptions(out=tmp_path / name, quick=True, model=session.opts.model, threads=1, hardware=hardware)
    result = run_lab(name, opts, session)
    assert result.report.is_file()
    text = result.report.read_text()
    assert text.startswith("# ") and "| " in text  # a title and at least one table of numbers
    assert result.plots
    for p in result.plots:
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({p.name})" in text
    assert json.loads((tmp_path / name / "results.json").read_text())
    assert result.summary
    return result.summary


def test_every_lab_has_an_effect_test():
    tested = {name[len("test_"):].replace("_", "-") for name in globals() if name.startswith("test_")}
    assert set(all_labs()) <= tested


def test_prefill_vs_decode(session, tmp_path):
    s = run_quick("prefill-vs-decode", session, tmp_path)
    pre = {p["size"]: p for p in s["points"] if p["phase"] == "prefill"}
    dec = {p["size"]: p for p in s["points"] if p["phase"] == "decode"}
    (p_lo, p_hi), (b_lo, b_hi) = sorted(pre), sorted(dec)
    # counted: decode reads the weights once per step whatever the batch, so a 4x batch does 4x the
    # FLOPs for a few % more bytes; prefill's FLOPs follow its tokens
    assert dec[b_hi]["flops"] / dec[b_lo]["flops"] == pytest.approx(b_hi / b_lo, rel=0.02)
    assert dec[b_hi]["bytes"] / dec[b_lo]["bytes"] < 1.15
    assert pre[p_hi]["flops"] / pre[p_lo]["flops"] > 0.9 * p_hi / p_lo
    # on the roofline: the long prefill right of the ridge (compute-bound), every decode left of it
    assert pre[p_hi]["intensity"] > s["ridge_point"] > max(p["intensity"] for p in dec.values())
    assert pre[p_hi]["bound"] == "compute" and {p["bound"] for p in dec.values()} == {"memory"}
    # measured: the long prefill gets far more FLOP/s out of the machine than a batch-1 decode step
    # (x12-15 here), and batching decode raises tokens/s (x2.2-2.7 on the Xeon, x1.42-1.43 in two
    # suite runs on a Zen 4). Only the direction is asserted: the size of a measured gain is the
    # lab's report, not a test's.
    assert pre[p_hi]["flops_per_s"] > 3 * dec[b_lo]["flops_per_s"]
    assert (b_hi / dec[b_hi]["wall_s"]) > b_lo / dec[b_lo]["wall_s"]


def test_kv_cache(session, tmp_path):
    s = run_quick("kv-cache", session, tmp_path)
    bs, bpt = s["block_size"], s["kv_bytes_per_token"]
    assert bpt == 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * TINY["head_dim"] * 4  # K, V; float32
    held = s["kv_held"]
    assert len(held["context"]) > 2 * bs  # the request crossed block boundaries
    for ctx, blocks, nbytes in zip(held["context"], held["blocks_used"], held["bytes_allocated"]):
        assert blocks == math.ceil(ctx / bs)  # whole blocks, no more
        assert ctx * bpt <= nbytes < (ctx + bs) * bpt  # linear in the context, within one block
    w, wo = s["with cache"], s["without cache"]
    assert set(w["tokens_per_step"]) == {1}  # one new position per step with the cache ...
    assert wo["tokens_per_step"] == wo["positions"]  # ... the whole sequence again without it
    assert wo["predicted_slope_s_per_position"] > 20 * w["predicted_slope_s_per_position"]
    # measured: re-running a 50-token sequence costs far more than one cached step (x3.9-4.6 here)
    assert s["median_ratio_common_range"] > 2.0


def test_attention_scaling(session, tmp_path):
    s = run_quick("attention-scaling", session, tmp_path)
    n, share, flops = s["prompt_lengths"], s["attention_share_predicted"], s["attention_flops"]
    # causal attention over n tokens: n(n+1)/2 query-key pairs, so its FLOPs are quadratic in n and its
    # share of the step (the rest is linear in n) grows with every length
    for k in range(1, len(n)):
        assert flops[k] / flops[0] == pytest.approx(n[k] * (n[k] + 1) / (n[0] * (n[0] + 1)), rel=1e-6)
        assert share[k] > share[k - 1]
    # measured: TTFT grows with the prompt (x2.7-2.9 from 32 to 192 tokens here)
    assert s["ttft_s"][-1] > 1.6 * s["ttft_s"][0]


def test_batching(session, tmp_path):
    s = run_quick("batching", session, tmp_path)
    b, t, tps = s["batch_sizes"], s["measured_step_s"], s["tokens_per_s"]
    # the cost model: memory-bound decode, the step predicted nearly flat in the batch
    assert set(s["bounds"]) == {"memory"}
    assert s["predicted_step_s"][-1] / s["predicted_step_s"][0] < 1.2
    # measured: 4x the sequences in a step cost far less than 4x the time (x1.5-1.9 here), so tokens/s
    # rises (x2.1-2.6 here)
    assert t[-1] / t[0] < 0.7 * b[-1] / b[0]
    assert tps[-1] > 1.4 * tps[0]


def test_latency_vs_throughput(session, tmp_path):
    s = run_quick("latency-vs-throughput", session, tmp_path)
    lo, hi = s["points"][0], s["points"][-1]
    # counted: the closed loop kept C requests in flight and the engine batched all of them
    assert lo["mean_decode_batch"] == 1 and hi["mean_decode_batch"] == pytest.approx(hi["concurrency"], rel=0.1)
    # measured: throughput rises with concurrency (x2.4-2.6 at C = 4 here). Each request's time per output token
    # rises too, but on this tiny model a step is mostly host work, and the rise (x1.1-1.7 across machines) is
    # too small to assert on a shared machine: the report carries it, the test only that it was measured
    assert hi["output_tokens_per_s"] > 1.5 * lo["output_tokens_per_s"]
    assert all(p["tpot_p50"] > 0 for p in (lo, hi))


def test_chunked_prefill(session, tmp_path):
    s = run_quick("chunked-prefill", session, tmp_path)
    plain = s["no chunking"]
    label, chunked = next((k, v) for k, v in s.items() if k.startswith("chunked"))
    chunk = chunked["chunk"]
    assert plain["prefill_steps"] == 1
    # counted: the long prompt went in chunks, each step within the budget and carrying the decodes
    with_prefill = [st for st in chunked["steps"] if st["prefill_tokens"] and st["t"] >= 0]
    assert len(with_prefill) == chunked["prefill_steps"] > 1
    assert all(st["prefill_tokens"] + st["decode_tokens"] <= chunk for st in with_prefill)
    assert all(st["decode_tokens"] > 0 for st in with_prefill)
    # measured: the decodes' worst gap while the prompt is prefilled is bounded by one chunk's step
    # (x4-5 shorter than the whole prefill here)
    assert chunked["stall_max_median_s"] < 0.6 * plain["stall_max_median_s"]


def test_validate(session, tmp_path, monkeypatch):
    # the spec of this machine, from a small probe (bandwidth, matmul peaks, the engine's kernel rates
    # and host overhead) cached where the lab looks for it; a datasheet spec would miss by 99%
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch.set_num_threads(1)  # the probe is keyed by the thread count the lab's engine runs with
    probe_local_cpu(force=True, bandwidth_bytes=32 * 2**20, matmul_size=256, runs=3)
    s = run_quick("validate", session, tmp_path, hardware=None)
    # VALIDATION.md documents 25% per point on SmolLM2 (steps of 20 ms to 4 s). A tiny model's steps of
    # 1 to 30 ms swing by up to 2x between a 4-second probe and the steps on this shared machine (seen:
    # decode +2..+70%, prefill -61..-1%, the -61% in a fresh-clone CI run), so the bound here is a factor
    # of 4 per point and a geometric mean error within 2.5x; a datasheet spec misses by ~100x, and a
    # count off by the batch or the layers by more than 4x
    ratio = {(p["phase"], p["size"]): p["predicted_s"] / p["measured_s"] for p in s["points"]}
    assert len(ratio) == 4
    for point, r in ratio.items():
        assert 0.25 < r < 4, (point, r)
    assert sum(abs(math.log(r)) for r in ratio.values()) / len(ratio) < math.log(2.5), ratio
    # and the prefill's growth with the prompt (its FLOPs at the compute peak) as measured, within 1.5x:
    # the steps of 256 and 512 tokens take a few ms each, three interleaved runs; a fresh-clone run on a
    # slow minute of this VM read 0.35 and 0.49 (1.38x; 2026-12-03 13:43 UTC), where 1.25 was the bound.
    # a prediction that does not grow with the prompt, or grows twice as fast, still fails it
    (lo, r_lo), (hi, r_hi) = sorted((n, r) for (phase, n), r in ratio.items() if phase == "prefill")
    assert 1 / 1.5 < r_hi / r_lo < 1.5, (r_lo, r_hi)
    # the mixed check ran every request through continuous batching: decode-only steps and steps mixing a
    # prefill chunk with decodes, each with its measured and predicted time
    mixed = s["mixed"]
    assert mixed["requests"] == 12 and {"decode", "mixed"} <= set(mixed["phases"])
    assert all(m > 0 and p > 0 for _, _, _, m, p in mixed["steps"])


def test_speculative(session, tmp_path):
    s = run_quick("speculative", session, tmp_path)
    rows = s["rows"]
    assert {(r["workload"], r["batch"], r["k"]) for r in rows} == {
        (w, b, k) for w in ("copy", "open") for b in (1, 4) for k in (2, 4)}
    for r in rows:
        assert 0.0 <= r["accepted_per_drafted"] <= 1.0 and r["measured_speedup"] > 0
        # on a datasheet GPU spec a tiny model's decode is memory-bound: verified rows are nearly free, so
        # every accepted draft is predicted to pay
        assert r["predicted_speedup"] > 1.0 or r["accepted_per_drafted"] == 0


def test_parallelism(session, tmp_path, monkeypatch):
    """TP=2 and PP=2 on two gloo processes beside one process: rank 0 spends part of each TP/PP step in
    collectives and none in one process; the predicted 70B decode step falls with TP over NVLink."""
    from servescope.analysis.collectives import LinkSpec
    from servescope.labs import parallelism

    # the local link's measurement spawns its own processes (seconds): a stand-in link for the report
    monkeypatch.setattr(parallelism, "local_gloo_link", lambda measure=True: LinkSpec("local-gloo", 1e9, 1e-4))
    s = run_quick("parallelism", session, tmp_path)
    pp = {"1x2 (1 micro-batch)", "1x2 (2 micro-batches)"}  # PP=2 with its stages in turn, and overlapped
    assert set(s["measured_step_s"]) == {"1x1", "2x1"} | pp and not s["skipped"]
    assert all(v == 0 for v in s["comm_share"]["1x1"].values())
    for layout in ("2x1", *pp):
        assert all(0 < v < 1 for v in s["comm_share"][layout].values())
    nv = [s["llama_3_70b_predicted_ms"][f"b16 H200/nvlink4 tp{tp}"][0] for tp in (1, 2, 4, 8)]
    assert nv == sorted(nv, reverse=True)


def test_quantization(session, tmp_path):
    """Fewer bytes per weight and per cached token: counted (resident weight bytes, KV bytes per token and
    the tokens a budget holds, the cost model's predicted steps) exactly or by order; timed only loosely."""
    s = run_quick("quantization", session, tmp_path)
    w, kv = s["weights"], s["kv"]
    assert {"float32", "int8", "int4"} <= set(w) and "gguf" not in w  # a random model has no GGUF blocks
    # the embedding (2048 x 256) stays float32 in every form; the projections shrink 4x / ~7x
    assert w["int4"]["weight_mib"] < w["int8"]["weight_mib"] < 0.5 * w["float32"]["weight_mib"]
    # a datasheet GPU: decode is memory-bound, the predicted step follows the weight bytes the model counts
    assert w["int8"]["predicted_s"] < 0.5 * w["float32"]["predicted_s"]
    # KV: 64 values + a 4-byte scale per row against 64 float32 values: 3.76x the tokens in the same budget
    assert kv["float32"]["bytes_per_token"] / kv["int8"]["bytes_per_token"] == pytest.approx(256 / 68)
    assert kv["int8"]["capacity_tokens"] / kv["float32"]["capacity_tokens"] >= 3.5
    assert kv["int8"]["bits_per_value"] == pytest.approx(8.5)
    assert kv["int8"]["predicted_s"] < kv["float32"]["predicted_s"] and kv["int8"]["bytes"] < kv["float32"]["bytes"]
    if "fp8_e4m3" in kv:
        assert kv["fp8_e4m3"]["capacity_tokens"] == kv["int8"]["capacity_tokens"]
    # measured: reading the int8 cache (dequantised a tile at a time) is not much slower than float32's
    assert 0 < kv["int8"]["measured_s"] < 2.0 * kv["float32"]["measured_s"]


def test_cluster(session, tmp_path):
    """Simulated (no weights): a 70B on H100s, colocated against prefill/decode disaggregation."""
    out = tmp_path / "cluster"
    run_quick("cluster", session, tmp_path)
    res = json.loads((out / "results.json").read_text())
    cvd = res["colocated_vs_disaggregated"]
    (colo_name, colo), (dis_name, dis) = sorted(cvd.items(), key=lambda kv: "colocated" not in kv[0])
    assert "colocated" in colo_name and "P" in dis_name
    # disaggregation keeps decodes away from prefills: its p90 TPOT is below the colocated one at every
    # rate, and the gap widens with the rate (the colocated decodes wait behind more prefill chunks)
    assert all(d["p90_tpot_ms"] < c["p90_tpot_ms"] for c, d in zip(colo, dis))
    assert colo[-1]["p90_tpot_ms"] - dis[-1]["p90_tpot_ms"] > colo[0]["p90_tpot_ms"] - dis[0]["p90_tpot_ms"]
    # its one prefill instance is what binds at the highest rate: a queue of prompts, goodput collapses
    assert dis[-1]["goodput"] < colo[-1]["goodput"] and dis[-1]["p90_ttft_ms"] > colo[-1]["p90_ttft_ms"]
    # data parallelism: two replicas hold about twice the rate of one, whatever the router
    for router, pts in res["saturation"].items():
        assert 1.5 < pts["2"] / pts["1"] < 2.5, (router, pts)


def test_simulate(session, tmp_path, monkeypatch):
    """The simulator against the engine on the same workloads: here the lab's quick mode on the tiny model
    (its preset is its config.json), two short workloads. On a tiny model's millisecond steps, on a shared
    machine, the bounds are wide: with the step table profiled on the engine every metric within 2x, with
    the cost model alone within 5x (a simulator of another model, a clock that does not advance, or a
    scheduler that never admits the requests misses by far more). docs/VALIDATION.md has the real floors,
    at 135M and 1B."""
    from servescope.labs import sim_validation as sv

    cfg = session.opts.model[len("random:"):]
    workloads = (sv.Workload("low rate", 6, (32, 64), (8, 16), 8.0),
                 sv.Workload("saturation", 8, (32, 64), (8, 16), math.inf))
    monkeypatch.setattr(sv, "QUICK", {"tiny": (session.opts.model, cfg, workloads)})
    monkeypatch.setattr(sv, "REAL_REPEATS", 1)
    opts = LabOptions(out=tmp_path / "simulate", quick=True, model=None, threads=1, hardware=SPEC)
    result = run_lab("simulate", opts, session)
    assert result.report.is_file() and "| " in result.report.read_text()
    rows = json.loads((tmp_path / "simulate" / "results.json").read_text())["rows"]
    assert [r["workload"] for r in rows] == ["low rate", "saturation"]
    for r in rows:
        for metric, m in r["metrics"].items():
            assert m["measured"] > 0, (r["workload"], metric)
            assert abs(m["step table error"]) < 1.0, (r["workload"], metric, m)
            assert abs(m["cost model error"]) < 4.0, (r["workload"], metric, m)
    # how far a step-time error moves each metric, on the simulator alone: all at once, every time follows the
    # steps and the throughput goes inversely; at the low rate the offered load sets the throughput
    sat = rows[1]["sensitivity"]
    assert sat["busy"] > 0.9 and sat["output_throughput"] == pytest.approx(-1.0, abs=0.1)
    assert sat["median_ttft_ms"] == pytest.approx(1.0, abs=0.1)
    assert 0 < rows[0]["sensitivity"]["busy"] < sat["busy"] and abs(rows[0]["sensitivity"]["output_throughput"]) < 0.5
    assert "How far a step-time error moves each metric" in result.report.read_text()


def test_moe(session, tmp_path):
    """The lab builds its own dense and MoE models (equal active parameters). Counted quantities only: the
    measured step times are the lab's report (a MoE step on a shared machine varies too much to bound)."""
    s = run_quick("moe", session, tmp_path)
    dense, moe = s["dense"], s["moe"]
    k, e = s["top_k"], s["experts"]
    # batch 1: exactly k experts per sparse layer (a token's top-k are distinct); then the uniform curve
    assert moe["distinct_measured"][0] == k and moe["distinct_predicted"][0] == k
    assert s["max_distinct_rel_error"] <= 0.10  # the floor: predicted within 10% of measured
    assert moe["distinct_measured"][-1] > 0.8 * e > 4 * k
    # bytes: the MoE's grow with the batch as more experts are read, far more than the dense model's
    assert moe["expert_bytes"][-1] / moe["expert_bytes"][0] == pytest.approx(
        moe["distinct_measured"][-1] / k, rel=0.05)
    moe_growth = moe["predicted_bytes"][-1] / moe["predicted_bytes"][0]
    assert moe_growth > 3 and moe_growth > 2 * dense["predicted_bytes"][-1] / dense["predicted_bytes"][0]
    # the measured routing and the uniform expectation price nearly the same bytes on random weights
    for measured, uniform in zip(moe["predicted_bytes"], moe["uniform_bytes"]):
        assert measured == pytest.approx(uniform, rel=0.1)
    assert s["moe_weight_bytes"] > 3 * s["dense_weight_bytes"]  # all E experts are held, k are active


def test_kv_layouts(session, tmp_path):
    s = run_quick("kv-layouts", session, tmp_path)
    lay, window = s["layouts"], s["sizes"]["window"]
    # counted: bytes per token on the cache tensors equal 2 x layers x KV heads x head_dim x 4 (float32), in
    # the ratio of the KV heads
    for name, r in lay.items():
        # MLA: one latent row of kv_lora_rank + qk_rope_head_dim = 64 + 16 per layer (the floor)
        want = 6 * (64 + 16) * 4 if name == "MLA" else 2 * 6 * r["kv_heads"] * 32 * 4
        assert r["bytes_per_token"] == r["predicted_bytes_per_token"] == want, name
    assert lay["MHA"]["bytes_per_token"] > 6 * lay["MLA"]["bytes_per_token"]
    assert lay["MHA"]["bytes_per_token"] == 4 * lay["GQA"]["bytes_per_token"] == 8 * lay["MQA"]["bytes_per_token"]
    # held per sequence, measured on the KV manager: the predicted count exactly; the windowed model flat past
    # its window at cdiv(W, S) + 1 blocks, full attention (and the hybrid's global layer) growing with the context
    for name, r in lay.items():
        for p in r["points"]:
            assert p["held_bytes"] == p["predicted_held_bytes"], (name, p)
    per_block = 16 * lay["windowed"]["bytes_per_token"]
    past = [p for p in lay["windowed"]["points"] if p["context"] > 2 * window]
    assert len(past) >= 2 and {p["held_bytes"] for p in past} == {(window // 16 + 1) * per_block}
    gqa, hybrid = lay["GQA"]["points"], lay["hybrid"]["points"]
    assert gqa[-1]["held_bytes"] > 3 * gqa[-3]["held_bytes"] and hybrid[-1]["one_table_bytes"] == gqa[-1]["held_bytes"]
    # a table per group keeps one layer in six whole: under half of what one table for all layers would hold
    assert hybrid[-1]["held_bytes"] < 0.5 * hybrid[-1]["one_table_bytes"]
    assert hybrid[-1]["capacity"] > 2 * gqa[-1]["capacity"]
    assert lay["windowed"]["points"][-1]["capacity"] > 2 * gqa[-1]["capacity"]
    # the cost model: the windowed step's prediction flat past the window, the full one's growing
    steps_w, steps_g = lay["windowed"]["steps"], lay["GQA"]["steps"]
    assert steps_w[-1]["predicted_s"] == pytest.approx(steps_w[1]["predicted_s"], rel=0.01)
    assert steps_g[-1]["predicted_s"] > steps_g[0]["predicted_s"]
