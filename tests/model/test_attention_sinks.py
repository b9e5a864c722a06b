"""Learned attention sinks (gpt-oss: one logit per query head in the softmax's denominator) with gpt-oss's
alternating windows, at the layer level against transformers' own GptOssAttention: q/k/v and o_proj biases, a
window of 16 on layer 0 and full attention on layer 1, 120 positions through the paged cache in prefill chunks
that cross window edges, then decode steps, on the reference backend and on the CPU backend (which hands a
layer with sinks to the reference). The experts of a gpt-oss model belong to the MoE layer kinds; the
attention here is the whole of what sinks change."""

import pytest
import torch

from servescope.config import ModelConfig
from servescope.model.attention.backend import AttentionMetadata
from servescope.model.attention.cpu import CpuAttentionBackend
from servescope.model.attention.reference import TorchAttentionBackend
from servescope.model.decoder import Attention

T, S, WINDOW, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 120, 16, 16, 4, 2, 16, 64
TOL = 1e-5


@pytest.fixture(scope="module")
def gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    cfg = GptOssConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM, num_hidden_layers=2, sliding_window=WINDOW, attention_bias=True,
                       vocab_size=100, intermediate_size=64, num_local_experts=4, max_position_embeddings=512)
    cfg._attn_implementation = "eager"
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    gen = torch.Generator().manual_seed(0)
    layers = []
    for i in range(2):
        attn = GptOssAttention(cfg, i).eval()
        with torch.no_grad():
            for p in attn.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if p.ndim == 1 else 0.1))
        layers.append(attn)
    x = torch.randn(1, T, HIDDEN, generator=gen)
    cos, sin = GptOssRotaryEmbedding(cfg)(x, torch.arange(T)[None])  # [1, T, D] (yarn, scaled)
    return layers, x, cos[0], sin[0]


def _hf_output(attn, x, cos, sin, window):
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (k <= q) & ((k > q - window) if window else True)
    mask = torch.zeros(T, T).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        return attn(x, (cos[None], sin[None]), mask)[0][0]  # [T, Dm]


def _ours(attn_hf, layer: int, sinks: bool = True) -> Attention:
    cfg = ModelConfig(architecture="llama", vocab_size=100, hidden_size=HIDDEN, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=512, sliding_window=WINDOW, layer_types=("sliding", "full"),
                      attention_bias=True, attention_out_bias=True, attention_sinks=sinks)
    spec = cfg.layer_specs()[layer]
    assert spec.attention.sinks == sinks and spec.attention.window == (WINDOW if layer == 0 else 0)
    ours = Attention(cfg, spec).eval()
    h = attn_hf
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(torch.cat([h.q_proj.weight, h.k_proj.weight, h.v_proj.weight]))
        ours.qkv_proj.bias.copy_(torch.cat([h.q_proj.bias, h.k_proj.bias, h.v_proj.bias]))
        ours.o_proj.weight.copy_(h.o_proj.weight)
        ours.o_proj.bias.copy_(h.o_proj.bias)
        if sinks:
            ours.sinks.copy_(h.sinks)
    return ours


def _paged_run(ours, backend, x, cos, sin, chunk, decode_from):
    """Our layer over the T positions through a paged cache: prefill chunks up to decode_from, then one
    token per step."""
    n_blocks = -(-T // S)
    kv = (torch.zeros(n_blocks, S, KV_HEADS, HEAD_DIM), torch.zeros(n_blocks, S, KV_HEADS, HEAD_DIM))
    table = torch.arange(n_blocks, dtype=torch.int32)[None]
    spans, p = [], 0
    while p < decode_from:
        spans.append((p, min(chunk, decode_from - p)))
        p += spans[-1][1]
    spans += [(i, 1) for i in range(decode_from, T)]
    half = HEAD_DIM // 2
    out = []
    with torch.no_grad():
        for start, n in spans:
            ctx = start + n
            meta = AttentionMetadata(
                slot_mapping=torch.arange(start, ctx), block_tables=table,
                context_lens=torch.tensor([ctx], dtype=torch.int32),
                query_start_loc=torch.tensor([0, n], dtype=torch.int32), query_lens_cpu=[n],
                context_lens_cpu=[ctx], max_query_len=n, max_context_len=ctx, num_decode_seqs=int(n == 1))
            cos_sin = (cos[start:ctx, None, :half].contiguous(), sin[start:ctx, None, :half].contiguous())
            out.append(ours(cos_sin, x[0, start:ctx], kv, meta, backend))
    return torch.cat(out)


@pytest.mark.parametrize("backend", [TorchAttentionBackend(), CpuAttentionBackend()], ids=["torch", "cpu"])
@pytest.mark.parametrize("chunk", [24, 7])
@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_sinks_match_transformers_gpt_oss_attention(gpt_oss, backend, chunk, layer):
    layers, x, cos, sin = gpt_oss
    ref = _hf_output(layers[layer], x, cos, sin, WINDOW if layer == 0 else 0)
    got = _paged_run(_ours(layers[layer], layer), backend, x, cos, sin, chunk, decode_from=90)
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"max |diff| {diff:.2e}"


def test_without_the_sinks_the_output_is_far(gpt_oss):
    layers, x, cos, sin = gpt_oss
    ref = _hf_output(layers[0], x, cos, sin, WINDOW)
    got = _paged_run(_ours(layers[0], 0, sinks=False), TorchAttentionBackend(), x, cos, sin, 24, decode_from=90)
    assert (got - ref).abs().max().item() > 1000 * TOL
