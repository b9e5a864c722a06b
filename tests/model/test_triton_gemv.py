"""The Triton GEMV (model/triton_gemv.py) against a float64 reference, its module wrapper, the
engine option that swaps it in, and a whole model with it against the same model on F.linear.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported), so shapes are small; `select(mode="auto")` times kernels with CUDA events and is
exercised on a GPU only (benchmarks/gpu.py)."""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

if not torch.cuda.is_available() and "servescope.kernels.triton.gemv" in sys.modules:
    importlib.reload(sys.modules["servescope.kernels.triton.gemv"])  # kernels defined before the flag was set

from servescope.config import EngineConfig  # noqa: E402
from servescope.errors import EngineConfigError  # noqa: E402
from servescope.kernels.triton import gemv as tg  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _ref(x, w, b=None):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_float64(dtype, m):
    g = torch.Generator().manual_seed(m)
    n, k = 37, 300  # neither a multiple of the row block nor of the K chunk
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    for bias in (None, b):
        y = tg.gemv(x, w, bias)
        assert y.shape == (m, n) and y.dtype == dtype
        ref = _ref(x.cpu(), w.cpu(), None if bias is None else bias.cpu())
        scale = ref.abs().max().item()
        assert (y.cpu().double() - ref).abs().max().item() <= TOL[dtype] * max(1.0, scale)


@pytest.mark.parametrize("config", [{"BLOCK_N": 1, "BLOCK_K": 16}, {"BLOCK_N": 16, "BLOCK_K": 64},
                                    {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8}])
def test_gemv_any_block_config_same_result(config):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 200, generator=g).to(DEV)
    w = torch.randn(50, 200, generator=g).to(DEV)
    ref = _ref(x.cpu(), w.cpu())
    assert (tg.gemv(x, w, config=config).cpu().double() - ref).abs().max().item() < 1e-4


def test_gemv_strided_rows_and_bad_shapes():
    g = torch.Generator().manual_seed(2)
    big = torch.randn(3, 2, 64, generator=g).to(DEV)
    x = big[:, 0, :]  # rows with a stride of 128
    w = torch.randn(24, 64, generator=g).to(DEV)
    assert torch.allclose(tg.gemv(x, w).cpu().double(), _ref(x.cpu(), w.cpu()), atol=1e-4)
    with pytest.raises(ValueError, match="M must be"):
        tg.gemv(torch.randn(tg.MAX_M + 1, 64, device=DEV), w)
    with pytest.raises(ValueError):
        tg.gemv(torch.randn(1, 63, device=DEV), w)
    with pytest.raises(ValueError, match="contiguous"):
        tg.gemv(torch.randn(1, 24, device=DEV), w.T)


def test_triton_linear_routes_only_its_rows():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40, bias=True).to(DEV)
    mod = tg.TritonLinear(lin, rows=(1, 2))
    calls = []
    real = tg.gemv
    try:
        tg.gemv = lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k))[1]
        with torch.no_grad():
            for m in (1, 2, 3, 9):
                x = torch.randn(m, 48, device=DEV)
                assert torch.allclose(mod(x), lin(x), atol=1e-5)
    finally:
        tg.gemv = real
    assert calls == [1, 2]  # M = 3 and 9 went to F.linear
    assert mod.weight is lin.weight and dict(mod.named_parameters()).keys() == {"weight", "bias"}


def test_select_triton_swaps_the_decoder_projections_and_keeps_the_outputs():
    import copy

    from servescope.config import ModelConfig
    from servescope.loader.random_init import build_random_model

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True})
    model = build_random_model(cfg, torch.float32, DEV, seed=3)
    ref = copy.deepcopy(model)
    choice = tg.select(model, "triton", rows=(1, 2))
    shapes = {(96 * 2, 64), (64, 96), (64 + 2 * 2 * 16, 64), (64, 64)}  # gate_up, down, qkv (biased), o
    assert set(choice) == {(n, k, m) for n, k in shapes for m in (1, 2)}
    assert {v["use"] for v in choice.values()} == {"triton"}
    for layer, ref_layer in zip(model.model.layers, ref.model.layers):
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(mod, tg.TritonLinear) and mod.rows == {1, 2}
        with torch.no_grad():
            for m in (1, 3):  # the Triton GEMV, F.linear
                x = torch.randn(m, 64, device=DEV)
                assert torch.allclose(layer.mlp(x), ref_layer.mlp(x), atol=1e-5)
                assert torch.allclose(layer.self_attn.qkv_proj(x), ref_layer.self_attn.qkv_proj(x), atol=1e-5)
    # a second call re-routes the already swapped modules: all back to F.linear
    back = tg.select(model, "cublas", rows=(1, 2))
    assert {v["use"] for v in back.values()} == {"cublas"}
    assert all(isinstance(layer.mlp.down_proj, tg.TritonLinear) and not layer.mlp.down_proj.rows
               for layer in model.model.layers)
    with pytest.raises(ValueError, match="mode"):
        tg.select(ref, "fastest")


def test_engine_option_is_validated():
    assert EngineConfig(gpu_linear="auto").gpu_linear == "auto"
    with pytest.raises(EngineConfigError, match="gpu_linear"):
        EngineConfig(gpu_linear="cutlass")


def test_engine_option_on_the_cpu_is_ignored_with_a_warning(tmp_path, caplog):
    import json
    import logging

    from servescope.engine.llm_engine import LLMEngine

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128,
           "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="servescope.engine.llm_engine"):
        eng = LLMEngine(EngineConfig(model=f"random:{tmp_path}", gpu_linear="triton", num_kv_blocks=8))
    assert eng.gpu_linear_choice == {}
    assert any("CUDA devices only" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine option acts on CUDA devices only")
@pytest.mark.parametrize("mode", ["triton", "auto"])
def test_engine_gpu_linear_keeps_greedy_outputs(tmp_path, mode):
    import json

    from servescope import LLM, SamplingParams

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = [[3 + (7 * i + j) % 250 for j in range(5 + 3 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for gl in ("cublas", mode):
        llm = LLM(model=f"random:{tmp_path}", dtype="float32", device="cuda", gpu_linear=gl,
                  kv_cache_memory_bytes=64 << 20)
        outs[gl] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
        if gl == "triton":
            assert {v["use"] for v in llm.engine.gpu_linear_choice.values()} == {"triton"}
        del llm
    assert outs[mode] == outs["cublas"]


def test_set_gpu_linear_validates_and_is_a_no_op_on_the_cpu(tmp_path):
    import json

    from servescope.config import SamplingParams
    from servescope.engine.llm_engine import LLMEngine

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128,
           "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = LLMEngine(EngineConfig(model=f"random:{tmp_path}", num_kv_blocks=8))
    with pytest.raises(EngineConfigError, match="gpu_linear"):
        eng.set_gpu_linear("cutlass")
    assert eng.set_gpu_linear("triton") == {}  # CPU: ignored, with the warning
    eng.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        eng.set_gpu_linear("cublas")
