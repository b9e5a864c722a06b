"""benchmarks/gpu.py is run only when a session is lent a GPU: its CPU dry run (tiny models, the
torch backend, Triton kernels in the interpreter) keeps every section working in between. The dry run
is a process of its own that needs nothing from the session, so it runs in the background while other
tests run (tests/background_jobs.py); its sections' limits count its CPU time, so waiting for a core
there does not cut it off."""

import json
import os
import sys
from pathlib import Path

import background_jobs  # tests/, on sys.path (tests/conftest.py's folder)

ROOT = Path(__file__).resolve().parents[2]
OUT = background_jobs.workdir() / "gpu_dry_run"
OUT.mkdir(exist_ok=True)

background_jobs.register("gpu_script/dry_run", [background_jobs.Command(
    [sys.executable, ROOT / "benchmarks" / "gpu.py", "--dry-run-cpu"], cwd=str(ROOT),
    env=dict(os.environ, OUT=str(OUT), PYTHONPATH=str(ROOT / "src")))], __name__)


def test_gpu_script_dry_run_every_section_ok():
    (proc,) = background_jobs.result("gpu_script/dry_run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((OUT / "gpu_results.json").read_text())
    assert res["mode"] == "dry-run-cpu"
    status = {s["section"]: s["status"] for s in res["sections"]}
    for name in ("kernels", "quant_kernels", "prefill", "hardware", "vs_hf_smollm2_fp32", "8b_batch1", "8b_b1_anatomy",
                 "8b_gpu_linear", "8b_vs_transformers"):
        assert status.get(name) == "ok", (name, status)
    metrics = {(r["section"], r["metric"]): r["value"] for r in res["rows"]}
    assert metrics[("vs_hf_smollm2_fp32", "vs_transformers_ok")] is True
    assert metrics[("quant_kernels", "quant_gemv_max_rel_err")] < 1e-4
    assert metrics[("prefill", "prefill_ok")] is True
    assert metrics[("8b_b1_anatomy", "gemvs_only_ms")] > 0
    assert metrics[("8b_gpu_linear", "triton_b1_decode_tokens_per_s")] > 0
