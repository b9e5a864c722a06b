"""Latent attention (DeepSeek's MLA) in the cost model: KV bytes per token are the latent row's (the issue's
floor: (kv_lora_rank + qk_rope_head_dim) x layers x dtype size), and a decode step's FLOPs (the absorbed
matmuls, attention over the latent rows) equal what torch's FlopCounterMode counts on the module itself."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from servescope.analysis import mla as mla_costs
from servescope.analysis.op_counts import attended_keys, kv_cache_bytes_per_token, weight_bytes
from servescope.config import ModelConfig
from servescope.config.mla import MlaSpec
from servescope.model.attention import TorchAttentionBackend
from servescope.model.attention.backend import AttentionMetadata
from servescope.model.mla import LatentAttention


def _cfg(q_lora_rank=0, layers=3):
    m = MlaSpec(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=q_lora_rank)
    return ModelConfig(architecture="deepseek_v3", vocab_size=64, hidden_size=48, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, head_dim=8, mla=m)


@pytest.mark.parametrize("kv_dtype,size", [("float32", 4), ("bfloat16", 2)])
def test_kv_bytes_per_token_are_the_latent_rows(kv_dtype, size):
    cfg = _cfg()
    assert kv_cache_bytes_per_token(cfg, kv_dtype) == (32 + 8) * 3 * size
    # the same heads as plain attention would hold 2 x 4 heads x (16 + 8) per layer: 4.8x more here
    assert weight_bytes(cfg, "float32") == cfg.num_parameters() * 4


@pytest.mark.parametrize("q_lora_rank", [0, 20])
def test_absorbed_decode_flops_equal_the_flop_counter(q_lora_rank):
    """Two sequences decoding at 48 cached tokens (whole blocks of 16, so the reference gathers no padding
    keys): the module's counted FLOPs equal the projections' and the absorbed attention's."""
    cfg = _cfg(q_lora_rank, layers=1)
    spec = cfg.layer_specs()[0]
    torch.manual_seed(0)
    attn = LatentAttention(cfg, spec)
    for p in attn.parameters():
        p.data.normal_(0, 0.1)
    ctx = [48, 48]  # equal: the reference pads every sequence's keys to the longest context
    cache = torch.zeros(8, 16, 1, cfg.mla.latent_dim)
    meta = AttentionMetadata(slot_mapping=torch.tensor([47, 95]), block_tables=torch.tensor([[0, 1, 2], [3, 4, 5]]),
                             context_lens=torch.tensor(ctx, dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), query_lens_cpu=[1, 1],
                             context_lens_cpu=ctx, max_query_len=1, max_context_len=48, num_decode_seqs=2)
    cos_sin = (torch.ones(2, 1, 4), torch.zeros(2, 1, 4))
    # SDPA's math path: its matmuls are aten ops the counter sees (the CPU's fused kernel it does not count)
    with FlopCounterMode(display=False) as fc, torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        attn(cos_sin, torch.randn(2, 48), (cache, cache[..., :0]), meta, TorchAttentionBackend())
    seqs = [(1, c - 1) for c in ctx]
    want = sum(mla_costs.projection_flops(cfg, 2).values()) + mla_costs.attention_flops(cfg, seqs, attended_keys)
    assert fc.get_total_flops() == want


def test_deepseek_v2_lite_preset():
    """DeepSeek-V2-Lite's published config: 15.7 B parameters, and 27 layers x (512 + 64) x 2 bytes of KV per
    token in bfloat16, against 2 x 27 x 16 heads x (128 + 64) x 2 had it cached per-head K and V."""
    from servescope.analysis.presets import load_preset

    cfg = load_preset("deepseek-v2-lite")
    assert 15.6e9 < cfg.num_parameters() < 15.8e9
    assert kv_cache_bytes_per_token(cfg, "bfloat16") == 27 * 576 * 2
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.mla.scale < (128 + 64) ** -0.5 * 1.6


def test_deepseek_v3_preset_and_its_explain_at_tp8_ep8():
    """DeepSeek-V3's published config: 671 B parameters (37 B active: 3 dense layers, 8 of 256 experts and the
    shared one), 61 layers x (512 + 64) x 2 bytes of latent KV per token in bfloat16 on every rank under TP (the
    latent serves all heads), and `explain` at TP=8 with EP=8 fits it on 8 H200s only with int8 weights."""
    from servescope.analysis.collectives import LINKS
    from servescope.analysis.hardware import get_hardware
    from servescope.analysis.parallel_explain import explain_parallel
    from servescope.analysis.presets import load_preset
    from servescope.config.moe import expert_parameters

    cfg = load_preset("deepseek-v3")
    assert 670e9 < cfg.num_parameters() < 672e9
    total, active = expert_parameters(cfg.moe.experts, cfg.hidden_size)
    dense = cfg.num_parameters() - cfg.moe.num_sparse(cfg.num_hidden_layers) * total
    assert 36e9 < dense + cfg.moe.num_sparse(cfg.num_hidden_layers) * active < 38e9
    assert kv_cache_bytes_per_token(cfg, "bfloat16") == 61 * 576 * 2
    hw, link = get_hardware("h200"), LINKS["nvlink4"]
    bf16 = explain_parallel(cfg, hw, link, 8, 1, batch=8, ep=8)
    int8 = explain_parallel(cfg, hw, link, 8, 1, batch=8, ep=8, weight_dtype="int8")
    assert bf16["max_concurrent_sequences"] == 0 < int8["max_concurrent_sequences"]
    assert all(p["all_to_all_seconds"] > 0 for p in int8["phases"])
