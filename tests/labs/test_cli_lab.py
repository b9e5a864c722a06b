"""`servescope explain | lab | hardware` through the real argument parser."""

import json
import os
import sys

import pytest
import torch

from servescope.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402


def test_explain_json_llama3_8b_has_required_keys(capsys):
    rc = main(["explain", "--config", "llama-3-8b", "--hardware", "H100-SXM", "--batch", "8",
               "--prompt-len", "128", "--output-len", "16", "--dtype", "bfloat16", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kv_cache_bytes_per_token"] == 131072  # 2 * 32 layers * 8 KV heads * 128 * 2 bytes
    assert r["weight_bytes"] > 15e9
    # short context: decode turns compute-bound at a finite batch (a long one never does on an H100)
    assert 50 < r["critical_batch_size"] < 1000
    assert r["critical_batch_size_no_context"] > 0
    assert r["max_concurrent_sequences"] > 0
    names = [p["name"] for p in r["phases"]]
    assert names == ["prefill", "decode"]
    for p in r["phases"]:
        assert {"name", "flops", "bytes", "predicted_seconds", "bound"} <= set(p)
    assert r["phases"][0]["bound"] == "compute" and r["phases"][1]["bound"] == "memory"


def test_explain_table_and_plot(tmp_path, capsys):
    png = tmp_path / "roof.png"
    rc = main(["explain", "--config", "qwen3-8b", "--hardware", "l4", "--kv-dtype", "float16", "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "bound" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_explain_model_dir_reads_config_only(tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    assert main(["explain", "--model", str(d), "--hardware", "a100", "--dtype", "float32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_explain_bad_hardware_is_one_line_exit_2(capsys):
    assert main(["explain", "--config", "llama-3-8b", "--hardware", "tpu-v9"]) == 2
    err = capsys.readouterr().err
    assert "unknown hardware" in err and len(err.strip().splitlines()) == 1


def _fake_probe_cache(tmp_path, monkeypatch):
    """A cached local-cpu spec so that nothing probes the machine during the test."""
    from servescope.analysis.probe import cache_key

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = {"name": "local-cpu", "kind": "cpu",
            "peak_flops": {"float32": 1e11, "bfloat16": 2e11, "float16": 1e9, "int8": 2e11},
            "memory_bandwidth": 2e10, "memory_bytes": 8 * 2**30, "notes": "fake", "source": "test"}
    path = tmp_path / "cache" / "servescope" / "hardware.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({cache_key(torch.get_num_threads()): spec}))


def test_hardware_list(tmp_path, monkeypatch, capsys):
    _fake_probe_cache(tmp_path, monkeypatch)
    assert main(["hardware", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("A100-40GB", "H100-SXM", "H200", "L4", "MI300X", "local-cpu"):
        assert name in out


def test_lab_list_and_unknown(capsys):
    assert main(["lab", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    # the labs of `lab all` (LABS), then validate, simulate, cluster and parallelism
    assert len(out) == 14 and out[0].startswith("prefill-vs-decode")
    assert any(line.startswith("parallelism") for line in out) and any(line.startswith("speculative") for line in out)
    assert any(line.startswith("quantization") for line in out)
    assert main(["lab", "nope"]) == 2


def test_explain_measure_on_tiny_model(tmp_path, monkeypatch, capsys):
    _fake_probe_cache(tmp_path, monkeypatch)
    model = make_tiny_hf_model(tmp_path, "llama")
    rc = main(["explain", "--model", str(model), "--batch", "2", "--prompt-len", "16", "--output-len", "5",
               "--dtype", "float32", "--measure", "--json", "--threads", "1"])
    assert rc == 0
    m = json.loads(capsys.readouterr().out)["measure"]
    assert m["hardware"] == "local-cpu"
    phases = {p["name"]: p for p in m["phases"]}
    assert set(phases) == {"prefill", "decode"}
    assert phases["decode"]["steps"] == 4  # output_len - 1 decode steps
    for p in phases.values():
        assert p["measured_seconds"] > 0 and p["predicted_seconds"] > 0
        assert p["error"] == pytest.approx((p["predicted_seconds"] - p["measured_seconds"]) / p["measured_seconds"])
