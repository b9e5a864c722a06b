"""`servescope quantize`: a checkpoint quantised once and saved packed loads as it is, in its mode,
with the same logits as quantising at load (plain rounding), and bad input writes nothing."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from servescope import LLM, SamplingParams
from servescope.bench.accuracy import accuracy_table
from servescope.cli import main
from servescope.engine.calibrate import quantize_checkpoint, sequence_logits
from servescope.errors import EngineConfigError, InvalidParameterError, ModelLoadError
from servescope.model.linears.packed import QuantLinear
from servescope.model.moe import PackedExperts, moe_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import MOE_FAMILIES, make_tiny_hf_model  # noqa: E402

KW = dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=256)
IDS = [(i * 37 + 11) % 500 + 3 for i in range(40)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("qc"), "llama", vocab_size=512, with_tokenizer=False,
                                  num_hidden_layers=2, tie_word_embeddings=True))


@pytest.mark.parametrize("mode", ["int4-g32-asym", "int8-g32", "int4-g128-asym"])
def test_saved_plain_rounding_is_quantising_at_load(tiny, tmp_path, mode):
    out = quantize_checkpoint(tiny, mode, str(tmp_path / "q"), method="rtn", skip_tokenizer_init=True).out
    cfg = json.loads(Path(out, "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "servescope", "mode": mode, "method": "rtn",
                                          "calibration": None, "calibration_tokens": 0, "damp": None}
    saved, at_load = LLM(model=out, **KW), LLM(model=tiny, quantization=mode, **KW)
    assert saved.engine.config.quantization == mode  # adopted from the directory: no flag needed
    mods = [m for _, _, m in saved.engine.executor.model.projections()]
    ref = [m for _, _, m in at_load.engine.executor.model.projections()]
    assert all(isinstance(m, QuantLinear) for m in mods)
    for a, b in zip(mods, ref):  # the same bytes, fused the same way
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    assert torch.equal(sequence_logits(saved.engine, IDS), sequence_logits(at_load.engine, IDS))
    assert saved.engine.weight_bytes == at_load.engine.weight_bytes
    assert (saved.generate([IDS], GREEDY)[0].outputs[0].token_ids
            == at_load.generate([IDS], GREEDY)[0].outputs[0].token_ids)


def test_gptq_checkpoint_runs_and_lowers_the_calibration_error(tiny, tmp_path):
    r = quantize_checkpoint(tiny, "int4-g32-asym", str(tmp_path / "g"), method="gptq", samples=4, tokens=64,
                            skip_tokenizer_init=True)
    assert r.calibration_tokens == 4 * 65 and len(r.errors) == 2 * 4 + 1  # 2 layers x 4 projections + head
    assert r.mean_error_ratio < 0.9, r.errors
    saved = LLM(model=r.out, **KW)
    assert saved.engine.config.quantization == "int4-g32-asym"
    assert torch.isfinite(sequence_logits(saved.engine, IDS)).all()
    assert len(saved.generate([IDS], GREEDY)[0].outputs[0].token_ids) == 12
    assert oct(os.stat(r.out).st_mode & 0o777) == "0o755"


def test_imatrix_checkpoint_weighs_the_search_by_the_calibration_activations(tiny, tmp_path):
    """--method imatrix: plain rounding's packed form, the scales searched by each input's mean squared
    activation: less output error on the calibration tokens than plain rounding, no GPTQ damping saved."""
    r = quantize_checkpoint(tiny, "int4-g32-asym", str(tmp_path / "i"), method="imatrix", samples=4, tokens=64,
                            skip_tokenizer_init=True)
    assert r.calibration_tokens == 4 * 65 and r.mean_error_ratio < 0.95, r.errors
    with open(os.path.join(r.out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["method"] == "imatrix" and qc["calibration_tokens"] == 4 * 65 and qc["damp"] is None
    assert torch.isfinite(sequence_logits(LLM(model=r.out, **KW).engine, IDS)).all()


def test_bad_input_writes_nothing(tiny, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(InvalidParameterError, match="not an empty directory"):
        quantize_checkpoint(tiny, "int4", str(full), method="rtn", skip_tokenizer_init=True)
    assert os.listdir(full) == ["keep.txt"]
    for mode, method, match in (("int5", "rtn", "unknown quantization"), ("int8", "rtn", "int8-ch"),
                                ("gguf", "rtn", "not a packed mode"), ("int4", "awq", "unknown method")):
        with pytest.raises(InvalidParameterError, match=match):
            quantize_checkpoint(tiny, mode, str(tmp_path / "x"), method=method, skip_tokenizer_init=True)
    with pytest.raises(InvalidParameterError, match="tokenizer"):  # a calibration text with no tokenizer
        quantize_checkpoint(tiny, "int4", str(tmp_path / "x"), calibration=str(full / "keep.txt"),
                            skip_tokenizer_init=True)
    assert sorted(os.listdir(tmp_path)) == ["full"]  # no half-written directory, no temporary left


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v2"])
def test_a_model_with_tensors_the_file_cannot_hold_is_refused_before_any_work(tmp_path, family):
    """gpt-oss's expert biases and sinks, DeepSeek's routers and latent attention (kv_b_proj): the saved file
    would lack them and fail at load, so the command refuses, naming a tensor, and writes nothing."""
    path = make_tiny_hf_model(tmp_path / "m", family, vocab_size=512, with_tokenizer=False)
    with pytest.raises(InvalidParameterError, match="does not save .* tensors yet .*--quantization int4"):
        quantize_checkpoint(str(path), "int4", str(tmp_path / "q"), method="rtn", skip_tokenizer_init=True)
    assert not (tmp_path / "q").exists() and sorted(os.listdir(tmp_path)) == ["m"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_mixture_of_experts_saved_by_plain_rounding_is_quantising_at_load(tmp_path, family):
    """Experts packed per expert under the names a GGUF's get, routers (and Qwen2-MoE's shared-expert gate) in
    float32, the shared expert split by its own width: the directory loads into the same packed experts, with
    the same bytes and logits, as --quantization at load."""
    path = str(make_tiny_hf_model(tmp_path / "m", family, vocab_size=512, with_tokenizer=False))
    out = quantize_checkpoint(path, "int4", str(tmp_path / "q"), method="rtn", skip_tokenizer_init=True).out
    saved, at_load = LLM(model=out, **KW), LLM(model=path, quantization="int4", **KW)
    blocks = [b for _, b in moe_blocks(saved.engine.executor.model)]
    ref = [b for _, b in moe_blocks(at_load.engine.executor.model)]
    assert blocks and all(isinstance(b.experts, PackedExperts) for b in blocks)
    for a, b in zip(blocks, ref):
        assert torch.equal(a.gate.weight, b.gate.weight)
        for la, lb in zip(a.experts.linears(), b.experts.linears()):
            assert torch.equal(la.qweight, lb.qweight) and torch.equal(la.scales, lb.scales)
    assert torch.equal(sequence_logits(saved.engine, IDS), sequence_logits(at_load.engine, IDS))
    assert saved.engine.weight_bytes == at_load.engine.weight_bytes
    assert (saved.generate([IDS], GREEDY)[0].outputs[0].token_ids
            == at_load.generate([IDS], GREEDY)[0].outputs[0].token_ids)


def test_a_mixture_of_experts_is_calibrated_per_expert(tmp_path):
    """--method imatrix / gptq: each expert's rounding weighed by the mean squared inputs of the tokens routed
    to it (counted during the calibration forwards): less weighted error than plain rounding for the experts
    the calibration reached; the file loads and generates."""
    path = str(make_tiny_hf_model(tmp_path / "m", "qwen2_moe", vocab_size=512, with_tokenizer=False))
    r = quantize_checkpoint(path, "int4", str(tmp_path / "g"), method="gptq", samples=4, tokens=64,
                            skip_tokenizer_init=True)
    assert r.expert_errors and all(name.count(".experts.") == 1 for name, _, _ in r.expert_errors)
    ratios = [e / p for _, e, p in r.expert_errors if p > 0]
    assert sum(ratios) / len(ratios) < 0.95, r.expert_errors
    saved = LLM(model=r.out, **KW)
    assert torch.isfinite(sequence_logits(saved.engine, IDS)).all()
    assert len(saved.generate([IDS], GREEDY)[0].outputs[0].token_ids) == 12


def test_a_saved_checkpoint_keeps_its_mode_and_its_shapes_are_checked(tiny, tmp_path):
    out = quantize_checkpoint(tiny, "int4", str(tmp_path / "q"), method="rtn", skip_tokenizer_init=True).out
    with pytest.raises(InvalidParameterError, match="already quantised"):
        quantize_checkpoint(out, "int4", str(tmp_path / "again"), method="rtn", skip_tokenizer_init=True)
    with pytest.raises(EngineConfigError, match="saved quantised as int4"):
        LLM(model=out, quantization="int8-g32", **KW)
    with pytest.raises(EngineConfigError, match="tensor/pipeline parallelism"):
        LLM(model=out, tensor_parallel_size=2, **KW)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.scales"
    tensors[name] = tensors[name][:, :-1].contiguous()  # one group's scale missing
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj does not match mode 'int4'"):
        LLM(model=out, **KW)


def test_cli_quantize_then_generate(tmp_path_factory, capsys):
    """The command on a model with a tokenizer (SmolLM2's): GPTQ on its own samples, then generate."""
    model = str(make_tiny_hf_model(tmp_path_factory.mktemp("qcli"), "llama", num_hidden_layers=2))
    out = tmp_path_factory.mktemp("qout") / "cli"
    assert main(["quantize", "--model", model, "--quantization", "int4-g32-asym", "--out", str(out),
                 "--calibration-samples", "2", "--calibration-tokens", "24", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "gptq / plain rounding" in " ".join(printed.split()), printed
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    assert main(["generate", "--model", str(out), "--max-tokens", "4", "--threads", "1", "Hello"]) == 0
    assert "int4-g32-asym linear weights" in " ".join(capsys.readouterr().out.split())  # (rich wraps lines)
    rows = accuracy_table(["A short text to score, twice. A short text to score, twice."], ["int4-g32-asym"],
                          model=model, saved=(str(out),), num_kv_blocks=16, max_model_len=128)
    assert [r["mode"] for r in rows] == ["int4-g32-asym", "int4-g32-asym (gptq, saved)"]
    assert all(r["kl"] >= 0 and r["weight_mib"] == rows[0]["weight_mib"] for r in rows)
    assert main(["quantize", "--model", model, "--quantization", "int4", "--out", str(out)]) == 2  # not empty
    assert "not an empty directory" in capsys.readouterr().err
