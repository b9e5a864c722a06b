"""The clients that need openai 2.x, from their own environment (.venv-clients, made by `make
install-test` from tests/clients/requirements.txt): instructor and llama-index against the server on
the embedded model, and guidellm, unmodified, running a concurrent benchmark with no errors."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import API_KEY, MODEL

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_PYTHON = Path(os.environ.get("SERVESCOPE_CLIENTS_VENV", ROOT / ".venv-clients")) / "bin" / "python"


def _clients_python() -> str:
    if not CLIENTS_PYTHON.exists():
        pytest.skip(
            f"{CLIENTS_PYTHON} is missing: `make install-test` creates it (instructor, llama-index and "
            "guidellm need openai 2.x, the test extra has openai 3.x)"
        )
    return str(CLIENTS_PYTHON)


GUIDELLM_TEST = "test_guidellm_concurrent_benchmark_has_no_errors"


@pytest.fixture(scope="module")
def guidellm_run(request, server, async_engine, tmp_path_factory):
    """guidellm's benchmark for its test, started as the module's first test starts: its processes spend
    seconds starting up and waiting, which the instructor and llama-index run fills. Where that test is
    not selected (make test-fast) or .venv-clients is missing, nothing starts."""
    if not CLIENTS_PYTHON.exists() or not any(item.name == GUIDELLM_TEST for item in request.session.items):
        yield None
        return
    tmp_path = tmp_path_factory.mktemp("guidellm")
    tokenizer = tmp_path / "tokenizer"
    async_engine.tokenizer.hf.save_pretrained(tokenizer)  # guidellm counts tokens with it (no hub access)
    report = tmp_path / "guidellm.json"
    cmd = [
        str(CLIENTS_PYTHON),
        "-m",
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={server.url},model={MODEL},api_key={API_KEY}",
        "--profile",
        "kind=concurrent,streams=4",
        "--constraint",
        "kind=max_requests,count=8",
        "--data",
        "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    log = tmp_path / "guidellm.log"  # a file, not a pipe that nobody reads until the test
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        yield proc, report, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.usefixtures("guidellm_run")  # guidellm starts first and runs meanwhile
def test_instructor_and_llama_index(server):
    py = _clients_python()
    r = subprocess.run(
        [py, str(ROOT / "tests/clients/openai2_clients.py"), server.url + "/v1", API_KEY, MODEL],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for mode in ("TOOLS", "JSON_SCHEMA"):
        assert set(out[f"instructor_{mode}"]) == {"country", "capital"}
    assert "Paris" in out["llama_complete"] and "Paris" in out["llama_chat"]
    assert out["llama_stream"] == out["llama_chat"]


@pytest.mark.slow
def test_guidellm_concurrent_benchmark_has_no_errors(guidellm_run):
    _clients_python()
    proc, report, log = guidellm_run
    assert proc.wait(timeout=900) == 0, log.read_text()[-5000:]
    totals = json.loads(report.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["total"] == 8 and totals["successful"] == 8, totals
