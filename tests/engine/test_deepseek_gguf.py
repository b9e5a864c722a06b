"""DeepSeek-V2 and V3 from GGUF files (llama.cpp's deepseek2): a tiny random transformers checkpoint of each, written
as llama.cpp's converter writes it (kv_b_proj split per head into attn_k_b, W_UK transposed, and attn_v_b; the
stacked experts, the float router, V3's correction bias as exp_probs_b; the latent's sizes, the experts' routing and
yarn's log multiplier as metadata; gguf-py, so it runs wherever the tests do), loads to the directory's config and to
transformers' float32 logits on the same weights with the same greedy tokens, also from the single attn_kv_b that
older converters wrote; a Q8_0 file loads, runs packed and generates; metadata whose maths is not implemented is
refused by name; llama.cpp's defaults fill absent keys; llama.cpp's own converter's files (where its tree is given:
LLAMA_CPP_DIR) load to transformers' logits too.

V2 is the query in one projection, softmax scores, grouped greedy top-k, routed scaling, two shared experts; V3 the
query's low-rank pair, sigmoid scores with the correction bias, groups by their best two, renormalised and scaled,
yarn rope. Its mscale is mscale_all_dim, as llama.cpp takes it (the converter writes only the latter)."""

import dataclasses
import os
import sys
from types import SimpleNamespace

import gguf
import pytest
import torch

from helpers import (gguf_engine, gguf_logits_diff, llama_cpp_convert, llama_cpp_tree, paged_logits,
                     transformers_with_weights)
from servescope import SamplingParams
from servescope.bench.accuracy import compare
from servescope.config.mla import yarn_mscale
from servescope.errors import ModelLoadError
from servescope.loader.gguf import _config_from_metadata, _Metadata
from servescope.loader.source import load_model_source
from servescope.model.linears.packed import QuantLinear
from servescope.model.moe import PackedExperts, moe_blocks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_gguf import write_tiny_deepseek_gguf  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

Q = gguf.GGMLQuantizationType
TOL = 1e-4
VOCAB = 256
V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
# (a q_lora_rank of whole Q8_0 blocks, so that q_b_proj runs packed too; the yarn over 64 positions, so that prompts
# of 120 reach past it)
MODELS = {"deepseek_v2": {}, "deepseek_v3": dict(q_lora_rank=64, rope_parameters=V3_YARN)}
IDS = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module", params=sorted(MODELS))
def deepseek_files(request, tmp_path_factory):
    """(family, HF directory, F32 GGUF, F32 GGUF with one attn_kv_b, Q8_0 GGUF) of one tiny family."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"gguf-{family}")
    hf = make_tiny_hf_model(tmp, family, vocab_size=VOCAB, with_tokenizer=False, **MODELS[family])
    src = load_model_source(str(hf))
    return (family, hf, write_tiny_deepseek_gguf(tmp / "f32.gguf", src),
            write_tiny_deepseek_gguf(tmp / "kv_b.gguf", src, split_kv_b=False),
            write_tiny_deepseek_gguf(tmp / "q8_0.gguf", src, qtype=Q.Q8_0))






def _same_specs(ours, want):
    """Layer specs equal, the latent's softmax scale within float32 rounding (yarn's multiplier is a float32)."""
    assert len(ours) == len(want)
    for a, b in zip(ours, want):
        la, lb = a.attention.latent, b.attention.latent
        assert la.scale == pytest.approx(lb.scale, rel=1e-6)
        strip = dataclasses.replace(la, softmax_scale=lb.softmax_scale)
        assert dataclasses.replace(a, attention=dataclasses.replace(a.attention, latent=strip)) == b


def test_gguf_config_is_the_directory_config(deepseek_files):
    """The same latent sizes, experts (router, groups, shared experts, scaling, dense first layer), rotary and
    family as the config.json the file was made from, from either form of kv_b."""
    family, hf_dir, f32, kv_b, _ = deepseek_files
    want = load_model_source(str(hf_dir)).config
    for path in (f32, kv_b):
        ours = load_model_source(path).config
        _same_specs(ours.layer_specs(), want.layer_specs())
        for key in ("architecture", "rope_theta", "rope_scaling", "tie_word_embeddings", "rms_norm_eps", "moe",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            assert getattr(ours, key) == getattr(want, key), key
    assert ours.architecture == family


@pytest.mark.parametrize("form", ["f32", "kv_b", "q8_0"])
def test_gguf_loads_to_transformers_logits(deepseek_files, form, tmp_path):
    """The file read as float32 equals transformers on its weights through prefill chunks (the expanded latents) and
    decode steps (the absorbed matmuls): kv_b_proj rebuilt from attn_k_b / attn_v_b bit for bit (a W_UK read
    untransposed, or heads out of order, would be far off), the correction bias, router and experts in place."""
    family, hf_dir, f32, kv_b, q8 = deepseek_files
    src = load_model_source({"f32": f32, "kv_b": kv_b, "q8_0": q8}[form])
    direct = load_model_source(str(hf_dir)).state_dict
    assert set(src.state_dict) == set(direct)
    for k, v in src.state_dict.items():
        if form != "q8_0" or v.dim() == 1 or k.endswith("mlp.gate.weight"):  # (Q8_0: the float ones)
            assert torch.equal(v, direct[k]), k
    diff = gguf_logits_diff(src, hf_dir, IDS, tmp_path)
    assert diff <= TOL, f"{family} {form}: max |logit diff| {diff:.2e}"


def test_gguf_greedy_tokens_are_transformers(deepseek_files, tmp_path):
    """40 prompt tokens, 40 greedy tokens: those of transformers' generate (neither stops at the end-of-sequence
    token, which comes up in a vocabulary of 256, nor holds it off)."""
    _, hf_dir, f32, _, _ = deepseek_files
    hf = transformers_with_weights(hf_dir, load_model_source(f32).state_dict, tmp_path)
    ids = IDS[:40]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                           attention_mask=torch.ones(1, 40, dtype=torch.long))[0, 40:].tolist()
    out = gguf_engine(f32).generate(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == want


def test_q8_0_file_runs_packed(deepseek_files):
    """quantization="gguf": the latent attention's projections (kv_b_proj stays float: its weight is read as W_UK and
    W_UV), the dense and shared MLPs, the experts (PackedExperts) and the embedding run over the file's Q8_0 blocks,
    within the packed GGUF KL floor of the float load of the same file, and generate."""
    family, _, _, _, q8 = deepseek_files
    ref, llm = gguf_engine(q8), gguf_engine(q8, quantization="gguf")
    model = llm.engine.runner.executor.model
    attn = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(m, QuantLinear) for a in attn for _, _, m in a.projections())
    assert all(type(a.kv_b_proj) is torch.nn.Linear for a in attn)
    assert [isinstance(b.experts, PackedExperts) for _, b in moe_blocks(model)] == [True]
    r = compare(paged_logits(ref.engine, IDS), paged_logits(llm.engine, IDS), IDS)
    assert r["kl"] / r["tokens"] <= 0.01, f"{family}: mean KL {r['kl'] / r['tokens']:.4f}"
    assert r["top1"] / r["tokens"] >= 0.9
    out = llm.generate(IDS[:40], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 20


# metadata or tensors a file must not run with, and what the refusal says
REFUSED = [({"deepseek2.attention.temperature_scale": 0.5}, "deepseek2.attention.temperature_scale is not implemented"),
           ({"deepseek2.nextn_predict_layers": 1}, "deepseek2.nextn_predict_layers is not implemented"),
           ({"deepseek2.expert_gating_func": 4}, "expert_gating_func 4 is not implemented"),
           ({"deepseek2.leading_dense_block_count": 0}, "leading_dense_block_count is 0 but the layers with a router"),
           ({"deepseek2.attention.value_length": 24}, "key_length 48 / value_length 24 must be"),
           ({"deepseek2.attention.q_lora_rank": 64}, "q_lora_rank is 64 but the file lacks blk.0.attn_q_a.weight"),
           (("linear", 4.0), "rope.scaling.type 'linear' is not implemented for deepseek2")]


def test_unimplemented_deepseek_metadata_is_refused(deepseek_files, tmp_path):
    """Each key whose maths the model would not apply (or that contradicts the tensors) is a load error naming it and
    the file; a softmax router given a correction bias too."""
    family, hf_dir, _, _, _ = deepseek_files
    if family != "deepseek_v2":
        pytest.skip("the refusals are read by the same code for both families (V2: softmax, no query LoRA)")
    src = load_model_source(str(hf_dir))
    for i, (edit, match) in enumerate(REFUSED):
        kw = {"rope_scaling": edit} if isinstance(edit, tuple) else {"extra_metadata": edit}
        path = write_tiny_deepseek_gguf(tmp_path / f"bad{i}.gguf", src, **kw)
        with pytest.raises(ModelLoadError, match=f"bad{i}.gguf.*{match}"):
            load_model_source(path)
    path = write_tiny_deepseek_gguf(tmp_path / "biased.gguf", src,
                                    extra_tensors={"blk.1.exp_probs_b.bias": torch.zeros(8).numpy()})
    with pytest.raises(ModelLoadError, match="biased.gguf.*exp_probs_b.*softmax gating is not implemented"):
        load_model_source(path)


def _config(tensors=("blk.1.ffn_gate_inp.weight",), **meta):
    """A ModelConfig from metadata alone: 2 layers, the second sparse, the query in one projection."""
    a = "deepseek2"
    base = {"general.architecture": a, f"{a}.embedding_length": 64, f"{a}.attention.head_count": 4,
            f"{a}.attention.head_count_kv": 1, f"{a}.attention.key_length": 48, f"{a}.attention.value_length": 32,
            f"{a}.attention.key_length_mla": 32, f"{a}.attention.value_length_mla": 24,
            f"{a}.attention.kv_lora_rank": 32, f"{a}.rope.dimension_count": 16, f"{a}.block_count": 2,
            f"{a}.feed_forward_length": 128, f"{a}.context_length": 4096, f"{a}.vocab_size": 256,
            f"{a}.leading_dense_block_count": 1, f"{a}.expert_count": 8, f"{a}.expert_used_count": 2,
            f"{a}.expert_feed_forward_length": 32, f"{a}.expert_shared_count": 1}
    reader = SimpleNamespace(fields={**base, **{k.replace("ARCH", a): v for k, v in meta.items()}},
                             tensors=[SimpleNamespace(name=n) for n in tensors])
    return _config_from_metadata(_Metadata(reader, "m.gguf"), reader, "m.gguf")


def test_llama_cpp_defaults():
    """What llama.cpp assumes where a key is absent: softmax routing (DeepSeek-V2's router), no renormalisation, no
    scaling, no groups, no dense layer first; a sigmoid router is V3's; yarn without the log multiplier scales cos
    and sin by mscale(factor) and the softmax by its square, with it the softmax by mscale(factor, all_dim) ** 2."""
    v2 = _config()
    e = v2.moe.experts
    assert v2.architecture == "deepseek_v2" and e.router == "deepseek_v2" and not e.norm_topk_prob
    assert (e.routed_scaling_factor, e.n_group, e.topk_group, e.shared_intermediate_size) == (1.0, 1, 1, 32)
    assert v2.mla.scale == 32 ** -0.5 and v2.mla.q_lora_rank == 0 and v2.rope_scaling is None
    v3 = _config(**{"ARCH.expert_gating_func": 2, "ARCH.expert_weights_norm": True, "ARCH.expert_weights_scale": 2.5,
                    "ARCH.expert_group_count": 4, "ARCH.expert_group_used_count": 2})
    e = v3.moe.experts
    assert v3.architecture == "deepseek_v3" and e.router == "deepseek_v3" and e.norm_topk_prob
    assert (e.routed_scaling_factor, e.n_group, e.topk_group) == (2.5, 4, 2)
    yarn = {"ARCH.rope.scaling.type": "yarn", "ARCH.rope.scaling.factor": 40.0}
    plain = _config(**yarn)
    assert plain.rope_scaling.original_max_position_embeddings == 4096  # the context, as llama.cpp's n_ctx_orig_yarn
    assert plain.rope_scaling.yarn_attention_factor == pytest.approx(yarn_mscale(40.0))
    assert plain.mla.scale == pytest.approx(32 ** -0.5 * yarn_mscale(40.0) ** 2)
    logged = _config(**yarn, **{"ARCH.rope.scaling.yarn_log_multiplier": 0.0707})
    assert logged.rope_scaling.yarn_attention_factor == pytest.approx(1.0)
    assert logged.mla.scale == pytest.approx(32 ** -0.5 * yarn_mscale(40.0, 0.707) ** 2, rel=1e-6)
    dense = _config(tensors=(), **{"ARCH.leading_dense_block_count": 2})
    assert dense.moe is None and [s.mlp.kind for s in dense.layer_specs()] == ["dense", "dense"]




@pytest.mark.parametrize("family", sorted(MODELS))
def test_llama_cpp_converter_output_loads_to_transformers_logits(family, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py (float32 out; the tiny checkpoint carries the SmolLM2 BPE tokenizer,
    which its DeepSeek vocabulary path reads) on a tiny checkpoint: the same layers and the same logits as
    transformers on the directory, kv_b_proj rebuilt from the converter's split attn_k_b / attn_v_b. The converter
    writes the gating function only from config.json's scoring_func, which DeepSeek's own files have and
    transformers' DeepseekV3Config does not write (without it llama.cpp would run softmax: refused, the file having
    a correction bias)."""
    from transformers import AutoModelForCausalLM

    root = llama_cpp_tree()
    scoring = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}[family]
    hf_dir = make_tiny_hf_model(tmp_path, family, scoring_func=scoring, **MODELS[family])
    out = tmp_path / "m.gguf"
    llama_cpp_convert(root, hf_dir, out)
    assert "blk.0.attn_k_b.weight" in {t.name for t in gguf.GGUFReader(str(out)).tensors}
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(3, 49152, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = gguf_engine(out)
    _same_specs(llm.engine.model_config.layer_specs(), load_model_source(str(hf_dir)).config.layer_specs())
    diff = (paged_logits(llm.engine, ids, chunk=24, decode_from=90) - ref).abs().max().item()
    assert diff <= TOL, f"{family}: max |logit diff| {diff:.2e}"
