"""The MLP kind "moe" as a specification: routing as transformers routes, the grouped expert execution equal
to a plain loop over every expert in float64 without reading an expert no token chose, each family's rule
for its sparse layers, the parameter count, the checkpoint's experts stacked at load, refusals naming the
field."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import MOE_FAMILIES, make_tiny_hf_model  # noqa: E402

from servescope.config import ModelConfig  # noqa: E402
from servescope.config.moe import ExpertsSpec  # noqa: E402
from servescope.errors import InvalidParameterError  # noqa: E402
from servescope.model.moe import Experts, grouped_experts, route  # noqa: E402
from servescope.model.moe_checkpoint import gpt_oss_checkpoint, stack_expert_checkpoint  # noqa: E402

QWEN_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
            "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2}


def _reference(x, ids, weights, gate_up, down):
    """Every expert over every token, masked by the routing: the MoE's definition, no grouping."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        g, u = (x @ gate_up[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u) @ down[e].T
        w = (weights * (ids == e)).sum(-1, keepdim=True)
        out += w * y
    return out


@pytest.mark.parametrize("tokens,k", [(1, 2), (7, 2), (33, 4), (5, 1)])
def test_grouped_experts_equal_the_definition_and_read_only_the_chosen(tokens, k):
    gen = torch.Generator().manual_seed(tokens)
    e, d, i = 16, 24, 40
    x = torch.randn(tokens, d, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(e, 2 * i, d, generator=gen, dtype=torch.float64) * 0.1
    down = torch.randn(e, d, i, generator=gen, dtype=torch.float64) * 0.1
    weights, ids = route(torch.randn(tokens, e, generator=gen, dtype=torch.float64), k, renormalise=True)
    want = _reference(x, ids, weights, gate_up, down)
    chosen = set(ids.flatten().tolist())
    unchosen = [j for j in range(e) if j not in chosen]
    gate_up[unchosen] = float("nan")  # an expert no token chose is never read: its NaNs cannot show
    down[unchosen] = float("nan")
    experts = Experts(e, d, i)
    experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
    got, counts = grouped_experts(x, ids, weights, experts)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert counts.tolist() == [int((ids == j).sum()) for j in range(e)] and int(counts.sum()) == tokens * k


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, 2, renormalise=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, p[:, :2])
    w, _ = route(logits, 2, renormalise=True)
    assert torch.allclose(w.sum(-1), torch.ones(1)) and torch.allclose(w, p[:, :2] / p[:, :2].sum())


def test_sparse_layers_follow_transformers_rule():
    cfg = ModelConfig.from_hf_dict({**QWEN_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [s.mlp.kind for s in cfg.layer_specs()] == ["dense", "moe", "dense", "dense", "dense", "moe"]
    cfg = ModelConfig.from_hf_dict({**QWEN_MOE, "mlp_only_layers": [0]})
    kinds = [s.mlp.kind for s in cfg.layer_specs()]
    assert kinds == ["dense"] + ["moe"] * 5
    e = cfg.layer_specs()[1].mlp.experts
    assert (e.num_experts, e.top_k, e.intermediate_size, e.norm_topk_prob) == (8, 2, 16, False)
    back = ModelConfig.from_hf_dict(cfg.to_hf_dict())  # the config.json we write reads back the same
    assert back.layer_specs() == cfg.layer_specs()


@pytest.mark.parametrize("field,value,match", [
    ("clip_qkv", 8.0, "clip_qkv"), ("num_experts_per_tok", 9, "need 0 < k <= E"),
    ("n_group", 4, "'n_group' is not known"),
    ("routed_scaling_factor", 2.5, "'routed_scaling_factor' is not known"),
])
def test_what_is_not_implemented_is_refused_naming_it(field, value, match):
    d = {**QWEN_MOE, field: value}
    if field == "clip_qkv":
        d.update(architectures=["OlmoeForCausalLM"], model_type="olmoe")
        d.pop("moe_intermediate_size")  # not an OLMoE field: itself refused
    with pytest.raises(InvalidParameterError, match=match):
        ModelConfig.from_hf_dict(d)
    with pytest.raises(InvalidParameterError, match="router 'sigmoid_grouped'"):
        ExpertsSpec(8, 2, 16, router="sigmoid_grouped")
    # DeepSeek is a family now: Qwen's expert fields in its config are refused by name, not run as a DeepSeek
    with pytest.raises(InvalidParameterError, match="'num_experts' is not known to servescope for deepseek_v3"):
        ModelConfig.from_hf_dict({**QWEN_MOE, "architectures": ["DeepseekV3ForCausalLM"],
                                  "model_type": "deepseek_v3"})
    # so is gpt-oss: Qwen's expert width is refused by name, not read as gpt-oss's
    with pytest.raises(InvalidParameterError, match="'moe_intermediate_size' is not known to servescope for gpt_oss"):
        ModelConfig.from_hf_dict({**QWEN_MOE, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"})


@pytest.mark.parametrize("family", [*MOE_FAMILIES, "gpt_oss"])
def test_parameter_count_equals_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path, family, with_tokenizer=False, vocab_size=256)
    hf = AutoModelForCausalLM.from_pretrained(path)
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_checkpoint_experts_stack_in_expert_order():
    sd = {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": torch.full((3, 2), 10.0 * e + j)
          for e in range(3) for j, w in enumerate(("w1", "w3", "w2"))}
    sd["model.layers.0.block_sparse_moe.gate.weight"] = torch.zeros(3, 2)
    out = stack_expert_checkpoint(sd)
    assert sorted(out) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
                           "model.layers.0.mlp.gate.weight"]
    gu = out["model.layers.0.mlp.experts.gate_up_proj"]
    assert gu.shape == (3, 6, 2) and gu[2, :3].eq(20).all() and gu[2, 3:].eq(21).all()  # gate | up per expert
    assert out["model.layers.0.mlp.experts.down_proj"][1].eq(12).all()
    partial = {"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(3, 2)}  # no up: kept
    assert list(stack_expert_checkpoint(dict(partial))) == list(partial)


def test_gpt_oss_experts_are_deinterleaved_and_transposed_at_load():
    """gpt-oss's gate_up_proj [E, Dm, 2I] (gate the even columns, up the odd) becomes rows gate | up [E, 2I, Dm];
    down_proj [E, I, Dm] becomes [E, Dm, I]; the router becomes mlp.gate. A layer without gpt-oss's router keeps
    its stacked tensors as they are (this model's own layout)."""
    e, d, i = 2, 3, 4
    gu = torch.arange(e * d * 2 * i, dtype=torch.float32).view(e, d, 2 * i)
    p = "model.layers.0.mlp."
    sd = {p + "router.weight": torch.zeros(e, d), p + "router.bias": torch.ones(e), p + "experts.gate_up_proj": gu,
          p + "experts.gate_up_proj_bias": torch.arange(2 * i, dtype=torch.float32).repeat(e, 1),
          p + "experts.down_proj": torch.randn(e, i, d), "model.layers.1.mlp.experts.gate_up_proj": gu}
    down = sd[p + "experts.down_proj"]
    gpt_oss_checkpoint(sd)
    assert sd[p + "gate.bias"].tolist() == [1.0, 1.0] and p + "router.weight" not in sd
    assert torch.equal(sd[p + "experts.gate_up_proj"][:, :i], gu[:, :, 0::2].transpose(1, 2))
    assert torch.equal(sd[p + "experts.gate_up_proj"][:, i:], gu[:, :, 1::2].transpose(1, 2))
    assert sd[p + "experts.gate_up_proj_bias"][0].tolist() == [0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]
    assert torch.equal(sd[p + "experts.down_proj"], down.transpose(1, 2))
    assert sd["model.layers.1.mlp.experts.gate_up_proj"] is gu
