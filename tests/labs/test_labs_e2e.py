"""Labs end to end in --quick mode on a tiny random model: each writes its PNG, report and results."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402

from servescope.labs import all_labs, run_lab  # noqa: E402
from servescope.labs.common import LabOptions, LabSession  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("labs"), "llama"))


@pytest.fixture(scope="module")
def session(tiny_model, tmp_path_factory):
    # a datasheet spec: predictions without running the CPU probe
    opts = LabOptions(out=tmp_path_factory.mktemp("out"), quick=True, model=tiny_model, threads=1,
                      hardware="A100-80GB")
    return LabSession(opts)


@pytest.mark.parametrize("name", list(all_labs()))
def test_lab_runs_quick_and_writes_outputs(name, session, tmp_path):
    opts = LabOptions(out=tmp_path / name, quick=True, model=session.opts.model, threads=1,
                      hardware="A100-80GB")
    result = run_lab(name, opts, session)
    assert result.report.is_file()
    text = result.report.read_text()
    assert text.startswith("# ") and "| " in text  # a title and at least one table of numbers
    assert result.plots
    for p in result.plots:
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({p.name})" in text
    json.loads((tmp_path / name / "results.json").read_text())
    assert result.summary
