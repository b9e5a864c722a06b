"""Mixture-of-experts from GGUF files and with packed experts: a tiny random HF MoE checkpoint of each family
written as llama.cpp writes it (stacked blk.N.ffn_*_exps experts, float router, expert metadata; gguf-py,
so it runs wherever the tests do) loads with the float32 logits of transformers on the same (dequantised)
weights; run packed (`quantization="gguf"`: the file's Q4_0 / Q8_0 blocks per expert), and an HF checkpoint
under --quantization int4 / int8, its experts are packed modules, each within the quantisation tests' KL
floor of the float run, reading fewer bytes; the file llama.cpp's own converter writes (where its tree is
given: LLAMA_CPP_DIR) loads to transformers' logits too."""

import os
import shutil
import sys

import gguf
import pytest
import torch

from helpers import gguf_engine, llama_cpp_convert, llama_cpp_tree, paged_logits
from servescope import LLM, SamplingParams
from servescope.bench.accuracy import compare
from servescope.errors import ModelLoadError
from servescope.kernels.cpu import ops as cpu_ops
from servescope.loader.source import load_model_source
from servescope.model.linears.int8 import Int8Linear
from servescope.model.linears.packed import QuantLinear
from servescope.model.moe import PackedExperts, moe_blocks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_gguf import write_tiny_moe_gguf  # noqa: E402
from tiny_models import MOE_FAMILIES, make_tiny_hf_model  # noqa: E402

Q = gguf.GGMLQuantizationType
TOL = 1e-4
VOCAB = 256
# Qwen2-MoE's shared expert at a width of whole 32-blocks (the tiny default, 48, is not)
OVERRIDES = {"qwen2_moe": {"shared_expert_intermediate_size": 64}}
IDS = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
SMALL = dict(num_kv_blocks=32, max_model_len=128)  # the engines' cache




@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_files(request, tmp_path_factory):
    """(family, HF directory, Q4_0 GGUF, Q8_0 GGUF) of one tiny family."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"gguf-{family}")
    hf = make_tiny_hf_model(tmp, family, vocab_size=VOCAB, with_tokenizer=False, **OVERRIDES.get(family, {}))
    src = load_model_source(str(hf))
    return family, hf, *(write_tiny_moe_gguf(tmp / f"{q}.gguf", src, qtype=Q[q]) for q in ("Q4_0", "Q8_0"))


def _transformers_logits(hf_dir, state_dict, tmp_path) -> torch.Tensor:
    """transformers' float32 logits of IDS, `state_dict` (HF names) in place of the directory's weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dequantised"
    out.mkdir()
    shutil.copy(hf_dir / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([IDS])).logits[0]


def test_gguf_moe_loads_to_transformers_logits(moe_files, tmp_path):
    """The Q4_0 file read as float32 (the blocks dequantised) equals transformers on those weights: names,
    stacking, Q/K order (Mixtral's "llama"), the shared expert's 1-D gate and the metadata all right."""
    family, hf_dir, q4, _ = moe_files
    src = load_model_source(q4)
    assert src.config.architecture == family
    assert src.config.moe == load_model_source(str(hf_dir)).config.moe  # experts, k, widths, sparse layers
    ref = _transformers_logits(hf_dir, src.state_dict, tmp_path)
    ours = paged_logits(gguf_engine(q4, **SMALL).engine, IDS, chunk=16, decode_from=48)
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"{family}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("qtype,floor", [("Q4_0", 0.01), ("Q8_0", 0.01)])
def test_gguf_experts_run_packed(moe_files, qtype, floor):
    """quantization="gguf": every sparse layer's experts are QuantLinears over the file's own blocks, within
    the packed-GGUF KL floor of the float32 load of the same file (the activations' int8 rounding: not 0),
    and the step records count a routed expert at its packed bytes."""
    family, _, q4, q8 = moe_files
    path = q4 if qtype == "Q4_0" else q8
    ref, llm = gguf_engine(path, **SMALL), gguf_engine(path, quantization="gguf", **SMALL)
    blocks = moe_blocks(llm.engine.runner.executor.model)
    assert blocks and all(isinstance(b.experts, PackedExperts) for _, b in blocks)
    assert all(isinstance(m, QuantLinear) for _, b in blocks for m in b.experts.linears())
    r = compare(paged_logits(ref.engine, IDS), paged_logits(llm.engine, IDS), IDS)
    assert 0 < r["kl"] / r["tokens"] <= floor, f"{family} {qtype}: mean KL {r['kl'] / r['tokens']:.4f}"
    assert r["top1"] / r["tokens"] >= 0.9
    assert llm.engine.weight_bytes < 0.45 * ref.engine.weight_bytes
    one = blocks[0][1].experts
    if cpu_ops.available():  # decode steps run the fused C++ op over these experts (tests/model/test_moe_fused.py)
        assert one._fused(torch.zeros(1, llm.engine.model_config.hidden_size)) is not None
    packed_bytes = one.gate_up[0].weight_bytes() + one.down[0].weight_bytes()
    llm.generate([[5, 9, 33]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    rec = llm.engine.step_records[-1]
    assert rec.moe_expert_bytes == sum(rec.moe_experts_active) * packed_bytes > 0


@pytest.mark.parametrize("mode,module,floor", [("int4", QuantLinear, 0.1), ("int8-g32", QuantLinear, 0.01),
                                               ("int8", Int8Linear, 0.01)])
def test_hf_moe_quantization_packs_the_experts(moe_files, mode, module, floor):
    """--quantization on an HF MoE checkpoint packs every routed expert (not only attention and the shared
    expert), within the mode's KL floor of float32."""
    family, hf_dir, _, _ = moe_files
    ref, llm = gguf_engine(hf_dir, **SMALL), gguf_engine(hf_dir, quantization=mode, **SMALL)
    blocks = moe_blocks(llm.engine.runner.executor.model)
    assert all(isinstance(m, module) for _, b in blocks for m in b.experts.linears())
    r = compare(paged_logits(ref.engine, IDS), paged_logits(llm.engine, IDS), IDS)
    assert r["kl"] / r["tokens"] <= floor, f"{family} {mode}: mean KL {r['kl'] / r['tokens']:.4f}"
    assert llm.engine.weight_bytes < (0.3 if mode == "int4" else 0.45) * ref.engine.weight_bytes


def test_unimplemented_routing_metadata_is_refused(tmp_path):
    hf = make_tiny_hf_model(tmp_path, "qwen3_moe", vocab_size=VOCAB, with_tokenizer=False)
    src = load_model_source(str(hf))
    path = write_tiny_moe_gguf(tmp_path / "sigmoid.gguf", src,
                               extra_metadata={"qwen3moe.expert_gating_func": 2})
    with pytest.raises(ModelLoadError, match="sigmoid.gguf.*expert_gating_func 2"):
        load_model_source(path)
    path = write_tiny_moe_gguf(tmp_path / "count.gguf", src, extra_metadata={"qwen3moe.expert_count": 4})
    with pytest.raises(ModelLoadError, match=r"count.gguf.*ffn_gate_exps.weight has shape \[8, 32, 64\]"):
        load_model_source(path)




@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_llama_cpp_converter_output_loads_to_transformers_logits(family, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py (float32 out) on a tiny checkpoint with every layer sparse: the
    same logits as transformers on the directory."""
    from transformers import AutoModelForCausalLM

    root = llama_cpp_tree()
    # (llama.cpp maps no dense layer here; its OLMoE converter writes an RMSNorm epsilon of 1e-5 whatever the
    # config says)
    hf_dir = make_tiny_hf_model(tmp_path, family, mlp_only_layers=[], rms_norm_eps=1e-5)
    out = tmp_path / "m.gguf"
    llama_cpp_convert(root, hf_dir, out)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = [i + 3 for i in IDS]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = LLM(model=str(out), **SMALL)
    assert llm.engine.model_config.architecture == family
    diff = (paged_logits(llm.engine, ids) - ref).abs().max().item()
    assert diff <= TOL, f"{family}: max |logit diff| {diff:.2e}"
    assert llm.engine.model_config.moe == load_model_source(str(hf_dir)).config.moe


def test_a_layer_of_mixed_expert_types_runs_float_with_one_warning(tmp_path, caplog):
    """Down experts in a type without a packed kernel (Q5_0) beside Q4_0 gate and up: those layers' experts are
    float32 (gate and up dequantised too), said in one warning naming the layers and their parts' types; the
    other layers stay packed, and the decode plan leaves the model to the modules."""
    import logging  # (stdlib; only this test reads the log)

    src = load_model_source(str(make_tiny_hf_model(tmp_path, "olmoe", vocab_size=VOCAB, with_tokenizer=False,
                                                   num_hidden_layers=3)))
    q5 = {f"blk.{i}.ffn_down_exps.weight": Q.Q5_0 for i in (1, 2)}
    path = write_tiny_moe_gguf(tmp_path / "mixed.gguf", src, qtype=Q.Q4_0, expert_types=q5)
    with caplog.at_level(logging.WARNING, logger="servescope.loader.gguf_experts"):
        llm = gguf_engine(path, quantization="gguf", **SMALL)
    lines = [r.getMessage() for r in caplog.records if "not packed" in r.getMessage()]
    assert len(lines) == 1 and "layer(s) 1, 2: gate Q4_0, up Q4_0, down Q5_0" in lines[0], lines
    blocks = moe_blocks(llm.engine.runner.executor.model)
    assert [isinstance(b.experts, PackedExperts) for _, b in blocks] == [True, False, False]
    assert llm.engine.runner.executor.decode_plan is not None  # the float layers on the dense fused op
