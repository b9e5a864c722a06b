"""Gemma 2 and Gemma 3 (text) from GGUF files: a tiny random transformers checkpoint of each, written as llama.cpp's
converter writes it (sandwich norms under llama.cpp's names, every norm stored with Gemma's 1 added, the
window, soft-caps and rotary bases as metadata; gguf-py, so it runs wherever the tests do), loads to the config
of the directory and to transformers' float32 logits on the same weights, windows of 16 under prompts of 120
tokens, with the same greedy tokens; a Q8_0 file loads and generates, float and kept packed; metadata whose maths
is not implemented is refused by name; llama.cpp's own converter's files (where its tree is given: LLAMA_CPP_DIR)
load to transformers' logits too, and llama.cpp itself (llama-server, where LLAMA_CPP_BIN or PATH has it)
gives their tokens our log-probabilities.

The query scalar is head_dim here: no GGUF key holds query_pre_attn_scalar, and llama.cpp takes head_dim (hidden
/ heads for the 27B models), as the 2B, 9B, 1B, 4B and 12B checkpoints have it."""

import os
import subprocess
import sys
from types import SimpleNamespace

import gguf
import pytest
import torch

from helpers import (gguf_engine, gguf_logits_diff, llama_cpp_tree, llama_server_greedy, paged_logits,
                     transformers_with_weights)
from servescope import SamplingParams
from servescope.bench.llama_cpp_tools import find_tool
from servescope.bench.accuracy import compare
from servescope.errors import ModelLoadError
from servescope.loader.gguf import _config_from_metadata, _Metadata
from servescope.loader.source import load_model_source
from servescope.model.linears.packed import QuantLinear

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_gguf import write_tiny_gemma_gguf  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

Q = gguf.GGMLQuantizationType
TOL = 1e-4
VOCAB = 256
WINDOW = 16
# as tests/engine/test_gemma.py: soft-caps near the tiny model's score and logit sizes; Gemma 3 with a pattern of 3
# (written as llama.cpp's sliding_window_pattern key) so that three layers hold both kinds, and the global layers'
# linear rope scaling of Gemma 3 4B and up (the local layers' rope stays plain)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
MODELS = {"gemma2": dict(num_hidden_layers=2, attn_logit_softcapping=0.05, final_logit_softcapping=2.0),
          "gemma3": dict(num_hidden_layers=3, sliding_window_pattern=3, rope_parameters=GEMMA3_ROPE)}
PATTERN = {"gemma2": {}, "gemma3": {"gemma3.attention.sliding_window_pattern": 3}}
IDS = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module", params=sorted(MODELS))
def gemma_files(request, tmp_path_factory):
    """(family, HF directory, F32 GGUF, Q8_0 GGUF) of one tiny family."""
    family = request.param
    tmp = tmp_path_factory.mktemp(f"gguf-{family}")
    hf = make_tiny_hf_model(tmp, family, vocab_size=VOCAB, with_tokenizer=False, sliding_window=WINDOW,
                            query_pre_attn_scalar=16, **MODELS[family])
    src = load_model_source(str(hf))
    return family, hf, *(write_tiny_gemma_gguf(tmp / f"{q}.gguf", src, qtype=Q[q], extra_metadata=PATTERN[family])
                         for q in ("F32", "Q8_0"))






def test_gguf_config_is_the_directory_config(gemma_files):
    """Windows on the same layers, soft-caps, rotary bases, query scalar, activation, norms and tied head as the
    config.json the file was made from; a file without a chat template gets Gemma's turns."""
    _, hf_dir, f32, _ = gemma_files
    src = load_model_source(f32)
    ours, want = src.config, load_model_source(str(hf_dir)).config
    assert "<start_of_turn>" in src.chat_template and src.tokenizer_source.chat_template == src.chat_template
    assert ours.layer_specs() == want.layer_specs()
    for key in ("architecture", "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                "rope_theta", "rope_local_theta", "rope_scaling", "query_pre_attn_scalar", "hidden_act",
                "norm_placement", "scale_embeddings", "qk_norm", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(ours, key) == getattr(want, key), key


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_loads_to_transformers_logits(gemma_files, qtype, tmp_path):
    """The file read as float32 equals transformers on its weights (the norms back in transformers' convention:
    within float32 rounding of the directory's), through prefill chunks crossing the window's edges and decode
    steps; a norm offset applied twice, or a norm under the wrong name, would be far off."""
    family, hf_dir, f32, q8 = gemma_files
    src = load_model_source(f32 if qtype == "F32" else q8)
    direct = load_model_source(str(hf_dir)).state_dict
    assert set(src.state_dict) == set(direct) - {"lm_head.weight"}
    for k, v in src.state_dict.items():
        if k.endswith("norm.weight") or qtype == "F32":
            assert torch.allclose(v, direct[k], rtol=0, atol=1e-6), k
    diff = gguf_logits_diff(src, hf_dir, IDS, tmp_path)
    assert diff <= TOL, f"{family} {qtype}: max |logit diff| {diff:.2e}"


def test_gguf_greedy_tokens_are_transformers(gemma_files, tmp_path):
    """40 prompt tokens (past the window of 16), 40 greedy tokens: those of transformers' generate."""
    _, hf_dir, f32, _ = gemma_files
    hf = transformers_with_weights(hf_dir, load_model_source(f32).state_dict, tmp_path)
    ids = IDS[:40]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                           attention_mask=torch.ones(1, 40, dtype=torch.long))[0, 40:].tolist()
    out = gguf_engine(f32).generate(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == want


def test_q8_0_file_runs_packed(gemma_files):
    """quantization="gguf": the projections and the embedding run over the file's Q8_0 blocks, within the packed
    GGUF KL floor of the float load of the same file, and generate."""
    family, _, _, q8 = gemma_files
    ref, llm = gguf_engine(q8), gguf_engine(q8, quantization="gguf")
    model = llm.engine.runner.executor.model
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) >= 3 * MODELS[family]["num_hidden_layers"]
    r = compare(paged_logits(ref.engine, IDS), paged_logits(llm.engine, IDS), IDS)
    assert r["kl"] / r["tokens"] <= 0.01, f"{family}: mean KL {r['kl'] / r['tokens']:.4f}"
    assert r["top1"] / r["tokens"] >= 0.9
    out = llm.generate(IDS[:40], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 20


# metadata a file must not run with ({key: value} added, or the global layers' rope scaling), and what the
# refusal says
REFUSED = {"gemma2": [({"gemma2.attention.scale": 0.25}, "gemma2.attention.scale is not implemented"),
                      ({"gemma2.rope.scaling.yarn_log_multiplier": 0.1}, "yarn_log_multiplier is not implemented"),
                      ({"gemma2.attention.value_length": 32}, "value_length 32 != key_length 16"),
                      ({"gemma2.final_logit_softcapping": 0.0}, "final_logit_softcapping must be positive")],
           "gemma3": [({"gemma3.attn_logit_softcapping": 50.0}, "gemma3.attn_logit_softcapping is not implemented"),
                      ({"gemma3.attention.sliding_window_pattern": [True, False]}, "one flag per layer"),
                      (("yarn", 8.0), "unsupported rope scaling type 'yarn'")]}


def test_unimplemented_gemma_metadata_is_refused(gemma_files, tmp_path):
    """Each key whose maths the model would not apply is a load error naming it and the file."""
    family, hf_dir, _, _ = gemma_files
    src = load_model_source(str(hf_dir))
    for i, (edit, match) in enumerate(REFUSED[family]):
        kw = {"rope_scaling": edit} if isinstance(edit, tuple) else {}
        meta = {**PATTERN[family], **(edit if isinstance(edit, dict) else {})}
        path = write_tiny_gemma_gguf(tmp_path / f"bad{i}.gguf", src, extra_metadata=meta, **kw)
        with pytest.raises(ModelLoadError, match=f"bad{i}.gguf.*{match}"):
            load_model_source(path)


def _config(arch, **meta):
    """A ModelConfig from metadata alone (no tensors: tied, Gemma 3's q/k norms from its row)."""
    base = {"general.architecture": arch, f"{arch}.embedding_length": 128, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 16, f"{arch}.block_count": 8,
            f"{arch}.feed_forward_length": 256, f"{arch}.context_length": 8192, f"{arch}.vocab_size": 256}
    reader = SimpleNamespace(fields={**base, **{k.replace("ARCH", arch): v for k, v in meta.items()}}, tensors=[])
    return _config_from_metadata(_Metadata(reader, "m.gguf"), reader, "m.gguf")


def test_llama_cpp_defaults_and_patterns():
    """What llama.cpp assumes where a key is absent, its two pattern forms and its 27B attention scale."""
    g2 = _config("gemma2")  # Gemma 2: window 4096 on even layers, soft-caps 50 / 30, local layers the global rope
    assert (g2.sliding_window, g2.attn_logit_softcapping, g2.final_logit_softcapping) == (4096, 50.0, 30.0)
    assert g2.layer_types == ("sliding", "full") * 4 and g2.rope_local_theta is None
    assert g2.query_pre_attn_scalar == 16 and g2.hidden_act == "gelu_pytorch_tanh"
    assert _config("gemma2", **{"ARCH.context_length": 4096}).sliding_window is None  # a window as long as the context
    g3 = _config("gemma3", **{"ARCH.attention.sliding_window": 512, "ARCH.rope.freq_base": 1e6})
    assert g3.layer_types == ("sliding",) * 5 + ("full", "sliding", "sliding")  # 5 local : 1 global
    assert (g3.rope_theta, g3.rope_local_theta, g3.final_logit_softcapping) == (1e6, 10000.0, None)
    assert g3.qk_norm and g3.attn_logit_softcapping is None
    assert _config("gemma3").sliding_window is None and _config("gemma3").rope_local_theta is None
    linear = _config("gemma3", **{"ARCH.attention.sliding_window": 512, "ARCH.rope.scaling.type": "linear",
                                  "ARCH.rope.scaling.factor": 8.0})
    assert (linear.rope_scaling.rope_type, linear.rope_scaling.factor, linear.rope_local_theta) == ("linear", 8, 1e4)
    flags = [True, False] * 4
    assert _config("gemma3", **{"ARCH.attention.sliding_window": 512, "ARCH.attention.sliding_window_pattern": flags,
                                "ARCH.rope.freq_base_swa": 5e4}).layer_types == ("sliding", "full") * 4
    assert _config("gemma2", **{"ARCH.attention.sliding_window_pattern": 0}).layer_types == ()  # all windowed
    big2 = _config("gemma2", **{"ARCH.block_count": 46})
    big3 = _config("gemma3", **{"ARCH.block_count": 62})
    assert (big2.query_pre_attn_scalar, big3.query_pre_attn_scalar) == (32, 32)  # hidden / heads, not head_dim 16
    assert big2.attention_scale == 32 ** -0.5




# Gemma 2's converter reads only a sentencepiece tokenizer.model; the tiny checkpoint carries the SmolLM2 BPE
# tokenizer, so its vocabulary is written as Gemma 3's converter does without one (the tensors and the metadata
# are the converter's own)
_CONVERT = """import sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[2:]
from conversion.gemma import Gemma2Model
Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
import convert_hf_to_gguf; convert_hf_to_gguf.main()"""


def _converted(family, tmp_path):
    """(HF directory, the GGUF llama.cpp's converter makes of it in float32) of a tiny checkpoint of `family`
    with llama.cpp's own layer patterns (Gemma 2 alternating, Gemma 3 five local layers to one global)."""
    root = llama_cpp_tree()
    layers = {"gemma2": dict(num_hidden_layers=2, attn_logit_softcapping=0.05, final_logit_softcapping=2.0),
              "gemma3": dict(num_hidden_layers=6, rope_parameters=GEMMA3_ROPE)}[family]
    hf_dir = make_tiny_hf_model(tmp_path, family, sliding_window=WINDOW, query_pre_attn_scalar=16, **layers)
    out = tmp_path / "m.gguf"
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "gguf-py")}
    cmd = [sys.executable, "-c", _CONVERT, root, os.path.join(root, "convert_hf_to_gguf.py"), str(hf_dir),
           "--outtype", "f32", "--outfile", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return hf_dir, out


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_llama_cpp_converter_output_loads_to_transformers_logits(family, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py (float32 out) on a tiny checkpoint: the same layers and the same
    logits as transformers on the directory."""
    from transformers import AutoModelForCausalLM

    hf_dir, out = _converted(family, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(3, 49152, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = gguf_engine(out)
    assert llm.engine.model_config.layer_specs() == load_model_source(str(hf_dir)).config.layer_specs()
    diff = (paged_logits(llm.engine, ids, chunk=24, decode_from=90) - ref).abs().max().item()
    assert diff <= TOL, f"{family}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_llama_cpp_agrees_with_us_on_the_converter_output(family, tmp_path):
    """llama.cpp itself (llama-server, where LLAMA_CPP_BIN or PATH has it) on the converter's file, 30 greedy steps
    after a 40-token prompt (past the window): at each, the log-probabilities of its top 5 tokens are ours on the
    same prefix within 0.05. ggml's rounding (its float16 GELU table, ...) moves them by up to 0.02 here; reading
    any of the window, the layer pattern, a rotary base, the rope scaling or the query scale otherwise moves
    them by 1 or more."""
    server = find_tool("llama-server")
    if server is None:
        pytest.skip("llama.cpp's llama-server not found (LLAMA_CPP_BIN)")
    _, out = _converted(family, tmp_path)
    ids = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    theirs, steps = llama_server_greedy(server, out, ids, tmp_path)
    ours = torch.log_softmax(paged_logits(gguf_engine(out).engine, ids + theirs)[len(ids) - 1:-1].double(), -1)
    worst = max(abs(ours[i, t["id"]].item() - t["logprob"]) for i, step in enumerate(steps)
                for t in step["top_logprobs"])
    assert worst <= 0.05, f"{family}: max |log-probability diff| {worst:.3f}"
