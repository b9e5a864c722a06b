"""analysis/kernel_table.py: the kernels timed at a model's own shapes, and how the cost model reads them."""

import dataclasses

import pytest

from servescope.analysis.cost_model import step_cost
from servescope.analysis.hardware import get_hardware
from servescope.analysis.kernel_table import (TABLE_VERSION, AttentionFit, KernelTable, decode_factor,
                                              fit_linear_model, interpolate, lookup, table_key)
from servescope.analysis.op_counts import attended_keys
from servescope.analysis.presets import load_preset

CFG = load_preset("smollm2-135m")
LINEAR = {"qkv_proj": [[1, 1e-4], [4, 2e-4], [64, 1e-3]], "o_proj": [[1, 5e-5], [64, 5e-4]],
          "gate_up_proj": [[1, 3e-4], [64, 2e-3]], "down_proj": [[1, 2e-4], [64, 1e-3]],
          "lm_head": [[1, 4e-3], [8, 5e-3]]}


def table_dict(cfg=CFG, wdt="bfloat16", adt="bfloat16", kdt="bfloat16", long_min=128, paged_max=1024) -> dict:
    return {"key": table_key(cfg, wdt, adt, kdt), "linear": LINEAR,
            "paged": {"fixed": 1e-6, "per_row": 2e-7, "per_key": 1e-8},
            "long": {"fixed": 1e-5, "per_row": 1e-6, "per_key": 2e-8},
            "long_min_tokens": long_min, "paged_max_context": paged_max, "misc": [[1, 3e-6], [512, 4e-4]]}


def test_interpolate_is_exact_at_points_linear_between_and_extends_the_last_slope():
    pts = [[1, 1.0], [4, 4.0], [8, 6.0]]
    assert interpolate(pts, 1) == 1.0 and interpolate(pts, 4) == 4.0 and interpolate(pts, 8) == 6.0
    assert interpolate(pts, 2) == pytest.approx(2.0) and interpolate(pts, 6) == pytest.approx(5.0)
    assert interpolate(pts, 12) == pytest.approx(8.0)  # slope 0.5 per row past the last point


def test_decode_rows_fitted_apart_from_short_chunks_fit_the_decode_points():
    # decode rows (one query per sequence) against short chunks, which read a sequence's keys once for all their
    # rows: one fit over both priced the decode rows at half their time
    decode = [(1, 129, 7e-6), (1, 2049, 2.8e-4), (8, 4104, 5.5e-4), (32, 4128, 6.1e-4), (32, 32800, 3.9e-3)]
    short = [(32, 528, 2.4e-5), (64, 34848, 2.2e-3)]
    apart, together = fit_linear_model(decode), fit_linear_model(decode + short)
    err = lambda f: max(abs(f.seconds(r, k) - t) / t for r, k, t in decode[1:])  # noqa: E731
    assert err(apart) < 0.15 < err(together)


def test_fit_recovers_an_exact_linear_model_and_keeps_coefficients_non_negative():
    truth = AttentionFit(2e-5, 3e-7, 4e-9)
    pts = [(r, k, truth.seconds(r, k)) for r, k in ((1, 128), (8, 4096), (32, 4096), (32, 32768), (64, 1000))]
    fit = fit_linear_model(pts)
    assert fit.fixed == pytest.approx(truth.fixed, rel=1e-6)
    assert fit.per_row == pytest.approx(truth.per_row, rel=1e-6)
    assert fit.per_key == pytest.approx(truth.per_key, rel=1e-6)
    # with a term per cached token before the sequence (a path that gathers its context)
    truth = AttentionFit(3e-6, 2e-6, 3e-8, 5e-7)
    pts = [(n, attended_keys(n, c), c, truth.seconds(n, attended_keys(n, c), c))
           for n, c in ((2, 0), (16, 0), (31, 0), (2, 128), (16, 128), (2, 512), (31, 512))]
    fit = fit_linear_model(pts, per_context=True)
    assert [getattr(fit, n) for n in ("fixed", "per_row", "per_key", "per_context")] == pytest.approx(
        [3e-6, 2e-6, 3e-8, 5e-7], rel=1e-6)
    assert fit_linear_model([(r, k, t) for r, k, _, t in pts]).per_context == 0.0
    # times that fall with the rows: the row term would be negative, so it is dropped and the rest refitted
    falling = [(1, 100, 5e-6), (10, 100, 4e-6), (20, 200, 3e-6)]
    fit = fit_linear_model(falling)
    assert fit.per_row == 0.0 and fit.fixed >= 0 and fit.per_key >= 0


def test_attention_routes_rows_as_the_cpu_backend_does():
    t = KernelTable.from_dict(table_dict())
    keys = lambda s: attended_keys(s[0], s[1])  # noqa: E731
    decode = [(1, 100)] * 4
    assert t.attention_seconds(decode, keys) == pytest.approx(t.paged.seconds(4, 4 * 101))
    # a long prefill is a call of its own; decodes and a short chunk share one paged call
    mixed = [(1, 100), (1, 50), (40, 10), (300, 0)]
    paged = t.paged.seconds(1 + 1 + 40, 101 + 51 + attended_keys(40, 10))
    assert t.attention_seconds(mixed, keys) == pytest.approx(paged + t.long.seconds(300, attended_keys(300, 0)))
    # short chunks only, over more context than the paged path takes: they run on the long path
    far = [(1, 2000), (40, 1500)]
    assert t.attention_seconds(far, keys) == pytest.approx(
        t.paged.seconds(1, 2001) + t.long.seconds(40, attended_keys(40, 1500)))
    # with a fit of their own, short chunks are priced by it and the decode rows by the decode fit
    split = KernelTable.from_dict({**table_dict(), "short": {"fixed": 2e-6, "per_row": 1e-7, "per_key": 3e-9}})
    assert split.attention_seconds(mixed, keys) == pytest.approx(
        split.paged.seconds(2, 101 + 51) + split.short.seconds(40, attended_keys(40, 10))
        + split.long.seconds(300, attended_keys(300, 0)))
    assert split.attention_seconds(decode, keys) == t.attention_seconds(decode, keys)
    assert KernelTable.from_dict(split.to_dict()) == split
    # a table without a short fit and long_min 2 (a quantised cache): every prefill sequence is its own call
    f32 = KernelTable.from_dict(table_dict(long_min=2, paged_max=0))
    assert f32.attention_seconds([(1, 10), (5, 0)], keys) == pytest.approx(
        f32.paged.seconds(1, 11) + f32.long.seconds(5, 15))
    # float32's short chunks: an SDPA call each over its gathered context, whatever the context (no limit: 0)
    sdpa = {"fixed": 1e-6, "per_row": 2e-6, "per_key": 3e-8, "per_context": 5e-7}
    f32 = KernelTable.from_dict({**table_dict(long_min=32, paged_max=0), "short": sdpa, "short_per_sequence": True})
    steps = [(1, 10), (5, 0), (20, 3000), (40, 100)]
    assert f32.attention_seconds(steps, keys) == pytest.approx(
        f32.paged.seconds(1, 11) + f32.short.seconds(5, 15, 0) + f32.short.seconds(20, attended_keys(20, 3000), 3000)
        + f32.long.seconds(40, attended_keys(40, 100)))
    assert f32.attention_seconds([(20, 3000)], keys) == pytest.approx(
        f32.short.seconds(20, attended_keys(20, 3000), 3000))  # no long sequence, far context: still SDPA's
    assert f32.short.seconds(20, 100, 3000) - f32.short.seconds(20, 100, 0) == pytest.approx(3000 * 5e-7)
    assert KernelTable.from_dict(f32.to_dict()) == f32


def test_step_cost_prices_the_timed_ops_from_the_table_and_the_rest_as_before():
    base = get_hardware("H100-SXM").replace(kind="cpu", name="local-cpu")
    hw = base.replace(kernel_tables={table_key(CFG, "bfloat16", "bfloat16", "bfloat16"): table_dict()})
    seqs = [(1, 100)] * 4
    c = step_cost(CFG, seqs, hw, "bfloat16")
    L = CFG.num_hidden_layers
    t = lookup(hw.kernel_tables, table_key(CFG, "bfloat16", "bfloat16", "bfloat16"))
    assert c.op("qkv_proj").seconds == pytest.approx(L * interpolate(LINEAR["qkv_proj"], 4))
    assert c.op("mlp").seconds == pytest.approx(L * (interpolate(LINEAR["gate_up_proj"], 4)
                                                     + interpolate(LINEAR["down_proj"], 4)))
    assert c.op("lm_head").seconds == pytest.approx(interpolate(LINEAR["lm_head"], 4))
    assert c.op("attention").seconds == pytest.approx(L * t.paged.seconds(4, 4 * 101))
    assert c.op("kv_read").seconds == 0 and c.op("kv_write").seconds == 0  # inside attention and misc
    assert c.op("norms_rope_misc").seconds == pytest.approx(L * interpolate(table_dict()["misc"], 4))
    plain = step_cost(CFG, seqs, base, "bfloat16")
    assert c.op("embedding").seconds == plain.op("embedding").seconds  # not timed: the roofline's
    # a table of other dtypes (or another shape) is never read
    f32 = step_cost(CFG, seqs, hw, "float32").predicted_seconds
    assert f32 == step_cost(CFG, seqs, base, "float32").predicted_seconds
    assert step_cost(CFG, seqs, hw, "bfloat16", num_logits=8).op("lm_head").seconds == pytest.approx(5e-3)


def test_the_samplers_rows_are_priced_with_the_head_at_the_steps_logit_rows():
    sample = [[1, 1e-4], [8, 6e-4]]
    key = table_key(CFG, "bfloat16", "bfloat16", "bfloat16")
    hw = get_hardware("H100-SXM").replace(kind="cpu", name="local-cpu",
                                          kernel_tables={key: {**table_dict(), "sample": sample}})
    t = lookup(hw.kernel_tables, key)
    assert t.sample_seconds(4) == pytest.approx(interpolate(sample, 4)) and t.sample_seconds(0) == 0.0
    c = step_cost(CFG, [(1, 100)] * 4, hw, "bfloat16")
    assert c.op("lm_head").measured
    assert c.op("lm_head").seconds == pytest.approx(interpolate(LINEAR["lm_head"], 4) + interpolate(sample, 4))
    # a prefill chunk that samples nothing pays no sampler; a table without the rows prices none
    assert step_cost(CFG, [(64, 0)], hw, "bfloat16", num_logits=0).op("lm_head").seconds == 0.0
    assert KernelTable.from_dict(table_dict()).sample_seconds(4) == 0.0
    assert KernelTable.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="sample"):
        KernelTable.from_dict({**table_dict(), "sample": [[8, 1e-4], [1, 1e-4]]})


def test_a_decode_only_step_on_the_plan_has_its_layers_priced_at_the_measured_factor():
    key = table_key(CFG, "bfloat16", "bfloat16", "bfloat16")
    L = CFG.num_hidden_layers
    spec = get_hardware("H100-SXM").replace(kind="cpu", name="local-cpu", layer_overhead_s=2e-5)
    host = L * spec.layer_overhead_s  # the plan's time holds the host overhead priced per layer beside it
    # [[rows, the plan's seconds, its kernels' seconds]]: factors 1.1, 1.3, 1.2 once the host overhead is taken off
    plan = [[1, host + 1.1 * 4e-3, 4e-3], [8, host + 1.3 * 6e-3, 6e-3], [32, host + 1.2 * 2e-2, 2e-2]]
    plain = spec.replace(kernel_tables={key: table_dict()})
    hw = spec.replace(kernel_tables={key: {**table_dict(), "decode_plan": plan, "decode_rows": 48}})
    t = lookup(hw.kernel_tables, key)
    layers = ("qkv_proj", "attention", "attn_out_proj", "mlp", "norms_rope_misc")

    def ratios(seqs, hw=hw, plain=plain):
        a, b = step_cost(CFG, seqs, hw, "bfloat16"), step_cost(CFG, seqs, plain, "bfloat16")
        return {o.name: o.seconds / b.op(o.name).seconds for o in a.ops if b.op(o.name).seconds > 0}

    # between the points interpolated, beyond the first and the last held flat, on every op the plan runs
    for rows, f in ((1, 1.1), (4, 1.1 + 0.2 * 3 / 7), (8, 1.3), (20, 1.25), (32, 1.2), (40, 1.2)):
        assert t.layers_factor([(1, 100)] * rows, host) == pytest.approx(f)
        r = ratios([(1, 100)] * rows)
        assert all(r[name] == pytest.approx(f) for name in layers), (rows, r)
        # the head, the sampler and the embedding are not the plan's
        assert r["lm_head"] == pytest.approx(1.0) and r["embedding"] == pytest.approx(1.0)
    # the factor follows the spec's own per-layer overhead (a probe measured again): none, the plan's whole time
    bare = spec.replace(layer_overhead_s=0.0)
    r = ratios([(1, 100)], bare.replace(kernel_tables=hw.kernel_tables),
               bare.replace(kernel_tables=plain.kernel_tables))
    assert r["mlp"] == pytest.approx((host + 1.1 * 4e-3) / 4e-3)
    # more rows than the plan serves run the model's forward; a step with prefill tokens runs it too, and its
    # linear ops keep the prefill factor alone
    assert t.layers_factor([(1, 100)] * 49, host) == 1.0
    assert all(v == pytest.approx(1.0) for v in ratios([(1, 9)] * 49).values())
    assert t.layers_factor([(1, 100), (5, 0)], host) == 1.0
    assert all(v == pytest.approx(1.0) for v in ratios([(1, 100), (5, 0)]).values())
    assert t.layers_factor([], host) == 1.0
    # a table without the plan's times (or measured where no plan runs: decode_rows 0) prices the kernels as timed
    assert KernelTable.from_dict(table_dict()).layers_factor([(1, 100)] * 4) == 1.0
    assert KernelTable.from_dict({**table_dict(), "decode_plan": plan, "decode_rows": 0}).layers_factor([(1, 9)]) == 1
    assert KernelTable.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="decode_plan"):
        KernelTable.from_dict({**table_dict(), "decode_plan": plan[::-1], "decode_rows": 8})


def test_the_decode_factor_is_the_plans_time_less_its_layers_host_overhead_over_their_kernels():
    assert decode_factor(1e-3, 1e-3, 0.0) == pytest.approx(1.0)
    assert decode_factor(1.3e-3, 1e-3, 1e-4) == pytest.approx(1.2)
    assert decode_factor(1e-3, 1e-3, 9e-4) == 0.5  # nearly all of it host overhead: a measurement gone wrong
    assert decode_factor(1e-1, 1e-3, 0.0) == 2.0  # a time slice lost in the plan's timing: likewise
    assert decode_factor(1e-3, 0.0, 0.0) == 1.0  # nothing priced: nothing to scale


def test_the_key_changes_with_what_the_table_holds():
    # a table cached before the sampler's rows, the written caches and the decode plan's factor is measured
    # again, not read back
    assert table_key(CFG, "bfloat16", "bfloat16", "bfloat16").endswith(f"|v{TABLE_VERSION}")
    assert TABLE_VERSION >= 5


def test_a_malformed_table_is_refused():
    bad = table_dict()
    bad["linear"] = {**LINEAR, "qkv_proj": [[4, 1e-4], [1, 2e-4]]}
    with pytest.raises(ValueError):
        KernelTable.from_dict(bad)
    missing = table_dict()
    missing["linear"] = {k: v for k, v in LINEAR.items() if k != "lm_head"}
    with pytest.raises(ValueError):
        KernelTable.from_dict(missing)


def test_the_key_names_shape_and_dtypes():
    one = load_preset("llama-3.2-1b")
    assert table_key(one, "q4_0", "float32", "float32") != table_key(one, "int4", "float32", "float32")
    assert table_key(one, "bfloat16", "bfloat16", "bfloat16") != table_key(CFG, "bfloat16", "bfloat16", "bfloat16")


def test_the_key_tells_apart_models_whose_layers_run_different_maths_at_equal_dimensions():
    one = load_preset("llama-3.2-1b")
    key = table_key(one, "bfloat16", "bfloat16", "bfloat16")
    capped = dataclasses.replace(one, attn_logit_softcapping=50.0)
    sinks = dataclasses.replace(one, attention_sinks=True)
    moe = load_preset("qwen3-30b-a3b")
    dense = dataclasses.replace(moe, moe=None)
    assert len({key, table_key(capped, "bfloat16", "bfloat16", "bfloat16"),
                table_key(sinks, "bfloat16", "bfloat16", "bfloat16")}) == 3
    bf16 = ("bfloat16",) * 3
    assert table_key(moe, *bf16) != table_key(dense, *bf16)
    assert key == table_key(load_preset("llama-3.2-1b"), "bfloat16", "bfloat16", "bfloat16")
