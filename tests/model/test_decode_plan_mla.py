"""DeepSeek-V2/V3 in the C++ DecodePlan (csrc/decode_plan_mla.h, csrc/decode_plan_router.h; model/plan_deepseek.py)
and MLA's one-kernel decode (latent_decode: the values read as the first r features of each latent row).

Every decode step the plan serves must equal the module path bit for bit (hidden states and the latent cache), on
tiny random DeepSeek-V2 (softmax group-limited routing, two shared experts, the query one projection) and V3
(sigmoid scores with the correction bias, groups by their best two, renormalised; with and without the query
LoRA), float32 and bfloat16, float and packed (int4) experts, at decode batches 1, 3 and 9. latent_decode equals
the full-width paged decode's first r outputs bit for bit (the kernels' own ISA paths: tests/kernels/
kernels_check.cpp); a DeepSeek model whose MLP the plan cannot compute runs on its modules as a whole."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from servescope import LLM, SamplingParams
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention.backend import AttentionBackend, AttentionMetadata
from servescope.model.attention.cpu import CpuAttentionBackend
from servescope.model.mla import LatentAttention
from servescope.model.moe import Experts, moe_blocks

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="CPU op extension not built here")

sys.path.insert(0, os.path.dirname(__file__))
from decode_plan_check import generate_comparing  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

SMALL = dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128)
PROMPTS = [[(i * 7 + j * 13) % 250 + 3 for i in range(n)] for j, n in enumerate((5, 19, 33, 2, 40, 9, 1, 12, 7))]
VARIANTS = {"v2": ("deepseek_v2", {}), "v3": ("deepseek_v3", {}),
            "v3-no-q-lora": ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False})}


def _llm(tmp_path, variant: str, **kw) -> LLM:
    family, overrides = VARIANTS[variant]
    path = make_tiny_hf_model(tmp_path, family, vocab_size=256, with_tokenizer=False, **overrides)
    return LLM(model=str(path), **SMALL, **kw)


@pytest.mark.parametrize("d,r", [(48, 32), (576, 512), (64, 48), (128, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_decode_is_the_full_width_decode_cut_to_r(d, r, dtype):
    """One kernel over the latent rows: keys whole, values their first r features; each output equals the paged
    decode's over whole rows (the computation it replaces) bit for bit, through the backend too."""
    gen = torch.Generator().manual_seed(d)
    cache = torch.randn(12, 16, 1, d, generator=gen).to(dtype)
    q = torch.randn(3, 5, d, generator=gen).to(dtype)
    tables = torch.randperm(12, generator=gen)[:12].view(3, 4).int()
    lens = torch.tensor([1, 40, 63], dtype=torch.int32)
    full = cpu_ops.paged_decode(q, cache, cache, tables, lens, 0.1)
    got = cpu_ops.latent_decode(q, cache, tables, lens, 0.1, r)
    assert got.shape == (3, 5, r) and torch.equal(got, full[..., :r])
    meta = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.long), block_tables=tables, context_lens=lens,
                             query_start_loc=torch.arange(4, dtype=torch.int32), query_lens_cpu=[1] * 3,
                             context_lens_cpu=lens.tolist(), max_query_len=1, max_context_len=63, num_decode_seqs=3)
    backend = CpuAttentionBackend()
    assert torch.equal(backend.latent_decode(q, cache, meta, 0.1, r), got)
    assert torch.equal(AttentionBackend.latent_decode(backend, q, cache, meta, 0.1, r), got)  # the generic form


@pytest.mark.parametrize("heads", [16, 12, 5])
def test_latent_decode_at_batch_1_splits_its_heads_over_the_threads_and_keeps_its_bits(heads):
    """One sequence over one latent head is one task per head tile once there are more threads than sequences:
    every head's output the same bits as on one thread, and the float64 reference's."""
    gen = torch.Generator().manual_seed(heads)
    d, r = 576, 512
    cache = torch.randn(8, 16, 1, d, generator=gen)
    q = torch.randn(1, heads, d, generator=gen)
    tables, lens = torch.randperm(8, generator=gen)[:5].view(1, 5).int(), torch.tensor([77], dtype=torch.int32)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_ops.latent_decode(q, cache, tables, lens, 0.05, r))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
    rows = cache[tables[0].long()].flatten(0, 1)[:77, 0].double()  # [L, d]
    p = torch.softmax(q[0].double() @ rows.T * 0.05, -1)  # [H, L]
    torch.testing.assert_close(outs[0][0].double(), p @ rows[:, :r], rtol=1e-5, atol=1e-5)


def test_latent_decode_refuses_bad_shapes():
    cache, tables = torch.zeros(4, 16, 1, 48), torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="v_dim"):
        cpu_ops.latent_decode(torch.zeros(1, 2, 48), cache, tables, lens, 0.1, 49)
    with pytest.raises(RuntimeError, match="width"):
        cpu_ops.latent_decode(torch.zeros(1, 2, 40), cache, tables, lens, 0.1, 32)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("float32", "int4"),
                                         ("bfloat16", "int4")])
def test_plan_matches_module_path_on_deepseek(tmp_path, variant, dtype, quant):
    llm = _llm(tmp_path, variant, dtype=dtype, quantization=quant)
    ex = llm.engine.runner.executor
    assert ex.decode_plan is not None and any(isinstance(layer.self_attn, LatentAttention) for layer in
                                              ex.model.model.layers)
    assert all(b.experts.fused_op() is not None for _, b in moe_blocks(ex.model))
    rows = ex.decode_plan.max_rows
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for n in (1, 3, 9):
        assert generate_comparing(llm, PROMPTS[:n], sp) == ({n: 5} if n <= rows else {})


def test_plan_counts_deepseek_experts_as_the_modules(tmp_path):
    """The plan adds each step's tokens per expert to the blocks' counts, as the module does: the step records'
    expert fields and the tokens equal an engine's that runs every step on the modules."""
    runs = []
    for use_plan in (True, False):
        llm = _llm(tmp_path, "v3", max_num_seqs=4)
        ex = llm.engine.runner.executor
        assert ex.decode_plan is not None
        if not use_plan:
            ex.layer_paths = [ex.model]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], sp)]
        runs.append((tokens, [(r.moe_experts_active, r.moe_tokens_per_expert) for r in llm.engine.step_records]))
    assert runs[0] == runs[1] and all(f[0] for f in runs[0][1])


def test_deepseek_with_an_mlp_off_the_plan_is_refused_as_a_whole(tmp_path, monkeypatch):
    """Experts without their fused op: the plan cannot compute the sparse layer, so no layer runs in it (the
    latent layers included); the modules serve every step."""
    monkeypatch.setattr(Experts, "fused", False)
    assert _llm(tmp_path, "v2").engine.runner.executor.decode_plan is None
