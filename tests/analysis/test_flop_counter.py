"""The cost model's matmul FLOPs equal torch's FlopCounterMode on a real HF model of the same shape."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from servescope.analysis.cost_model import (  # noqa: E402
    attention_flops_noncausal, matmul_flops, step_cost,
)
from servescope.analysis.hardware import get_hardware  # noqa: E402
from servescope.config import ModelConfig  # noqa: E402

_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def _tiny(arch, **kw):
    base = dict(architecture=arch, vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    base.update(kw)
    return ModelConfig(**base)


CONFIGS = [
    _tiny("llama"),
    _tiny("llama", tie_word_embeddings=True, num_key_value_heads=6),
    _tiny("qwen2", attention_bias=True),
    _tiny("qwen3", qk_norm=True, head_dim=12),  # head_dim * heads != hidden: q_size differs from d
]


def _counts(cfg, T, logits_to_keep, attn="sdpa"):
    hf_cfg = getattr(transformers, _CONFIG_CLASSES[cfg.architecture])(**cfg.to_hf_dict(), attn_implementation=attn)
    torch.manual_seed(0)
    model = getattr(transformers, _HF_CLASSES[cfg.architecture])(hf_cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(ids, logits_to_keep=logits_to_keep)
    return fc.get_flop_counts()


def _linear(counts, suffixes):
    aten = torch.ops.aten
    total = 0
    for mod, per_op in counts.items():
        if mod.rsplit(".", 1)[-1] in suffixes:
            total += sum(v for op, v in per_op.items() if op in (aten.mm, aten.addmm))
    return total


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.architecture}-tied{c.tie_word_embeddings}")
@pytest.mark.parametrize("T,keep", [(7, 0), (5, 1)])
def test_matmul_flops_match_flop_counter(cfg, T, keep):
    counts = _counts(cfg, T, keep)
    n_logits = T if keep == 0 else keep
    ours = matmul_flops(cfg, T, n_logits)
    assert ours["qkv_proj"] == _linear(counts, {"q_proj", "k_proj", "v_proj"})
    assert ours["attn_out_proj"] == _linear(counts, {"o_proj"})
    assert ours["mlp"] == _linear(counts, {"gate_proj", "up_proj", "down_proj"})
    assert ours["lm_head"] == _linear(counts, {"lm_head"})
    aten = torch.ops.aten
    all_mm = sum(v for op, v in counts["Global"].items() if op in (aten.mm, aten.addmm))
    assert sum(ours.values()) == all_mm
    # the step cost model's linear ops carry exactly these FLOPs
    step = step_cost(cfg, [(T, 0)], get_hardware("H100"), "float32", num_logits=n_logits)
    for name in ours:
        assert step.op(name).flops == ours[name]


def test_eager_attention_is_counted_non_causal():
    cfg = CONFIGS[0]
    T = 9
    counts = _counts(cfg, T, 1, attn="eager")
    bmm = counts["Global"].get(torch.ops.aten.bmm, 0)
    assert bmm == attention_flops_noncausal(cfg, [(T, 0)])
