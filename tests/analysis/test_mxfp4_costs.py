"""gpt-oss as released (its routed experts MXFP4, the rest bfloat16: the gpt-oss-20b / -120b presets): the cost
model, the memory planner and explain count each expert at MXFP4's 4.25 bits per weight (one E8M0 byte per 32
nibbles), whatever the other weights' dtype."""

from dataclasses import replace

import pytest

from servescope.analysis.cost_model import step_cost
from servescope.analysis.explain import explain
from servescope.analysis.hardware import get_hardware
from servescope.analysis.op_counts import weight_bytes
from servescope.analysis.presets import load_preset


def _float_experts(cfg):
    return replace(cfg, moe=replace(cfg.moe, experts=replace(cfg.moe.experts, weight_format="")))


@pytest.mark.parametrize("name,params,gib", [("gpt-oss-20b", 20.9e9, 12.8), ("gpt-oss-120b", 116.8e9, 60.7)])
def test_presets_weigh_what_the_release_weighs(name, params, gib):
    cfg = load_preset(name)
    e = cfg.moe.experts
    assert e.weight_format == "mxfp4" and cfg.num_parameters() == pytest.approx(params, rel=0.01)
    expert_weights = cfg.num_hidden_layers * e.num_experts * 3 * e.intermediate_size * cfg.hidden_size
    saved = weight_bytes(_float_experts(cfg), "bfloat16") - weight_bytes(cfg, "bfloat16")
    assert saved == pytest.approx(expert_weights * (2 - 4.25 / 8), rel=1e-6)
    assert weight_bytes(cfg, "bfloat16") / 2**30 == pytest.approx(gib, rel=0.01)  # the released files' size


def test_decode_step_reads_mxfp4_experts():
    cfg = load_preset("gpt-oss-20b")
    hw = get_hardware("h100")
    e = cfg.moe.experts
    per_expert_saved = 3 * e.intermediate_size * cfg.hidden_size * (2 - 4.25 / 8)
    ops = {o.name: o for o in step_cost(cfg, [(1, 1000)], hw).ops}
    ops_float = {o.name: o for o in step_cost(_float_experts(cfg), [(1, 1000)], hw).ops}
    mlp, mlp_float = ops["mlp"], ops_float["mlp"]
    # batch 1: top_k distinct experts per sparse layer
    assert mlp_float.weight_bytes - mlp.weight_bytes == pytest.approx(
        cfg.num_hidden_layers * e.top_k * per_expert_saved, rel=1e-6)
    result = explain(cfg, hw)
    assert result["moe"]["expert_format"] == "mxfp4"
    assert result["weight_bytes"] == weight_bytes(cfg, "bfloat16")
