"""int8 weight-only quantization: close logits, high greedy agreement, perplexity within 2%."""

import math

import pytest
import torch

from servescope import LLM, SamplingParams
from servescope.model.linears.int8 import Int8Linear
from servescope.quant.per_channel import quantize_per_channel

TEXT = ("The sea was calm that morning. Fishermen pushed their boats into the water and rowed out past "
        "the harbour wall, where the gulls circled and cried. By noon the wind had turned, and the sky "
        "grew dark over the hills to the west. ") * 3


def test_per_channel_roundtrip():
    w = torch.randn(64, 128) * torch.linspace(0.01, 3, 64)[:, None]
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (q.float() * s[:, None] - w).abs().max(dim=1).values
    assert torch.all(err <= s / 2 + 1e-6)  # at most half a quantisation step per channel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_dequantised(dtype):
    lin = torch.nn.Linear(96, 40, bias=True)
    q = Int8Linear(lin.weight.data, lin.bias, dtype)
    x = torch.randn(5, 96, dtype=dtype)
    qw, s = quantize_per_channel(lin.weight.data)
    ref = x.float() @ (qw.float() * s[:, None]).T + lin.bias.float()
    assert torch.allclose(q(x).float(), ref, atol=3e-2 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2)


def perplexity(llm, ids):
    engine = llm.engine
    from helpers import paged_logits

    logits = paged_logits(engine, ids)
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)


def test_int8_smollm2_perplexity_and_agreement(smollm2_llm):
    q = LLM(quantization="int8", num_kv_blocks=256, max_model_len=2048)
    ids = smollm2_llm.tokenizer.encode(TEXT)
    p_ref, p_q = perplexity(smollm2_llm, ids), perplexity(q, ids)
    assert abs(p_q - p_ref) / p_ref <= 0.02, f"perplexity float32 {p_ref:.3f}, int8 {p_q:.3f}"
    # greedy agreement over a continuation (stated in docs/BENCHMARKS.md; the floor here is loose)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    a = smollm2_llm.generate(ids[:40], params)[0].outputs[0].token_ids
    b = q.generate(ids[:40], params)[0].outputs[0].token_ids
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    assert agree >= 8, f"int8 greedy diverged after {agree} tokens"
    # linear layers and the head in int8; the float embedding table stays for lookups
    assert q.engine.weight_bytes < 0.5 * smollm2_llm.engine.weight_bytes
