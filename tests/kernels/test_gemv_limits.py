"""The GEMV's row limit for a bfloat16 weight, measured per machine and shape (kernels/cpu/gemv_limits.py): the rule
that picks it from the timings, the cache (written whole, read back without timing again, not written from a busy
machine), the defaults where nothing is measured, a real timing, and the decode plan bit for bit with the modules
when the limit is not linear.MAX_ROWS."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from servescope.kernels.cpu import gemv_limits
from servescope.kernels.cpu import linear as cpu_linear
from servescope.kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="CPU op extension not built here")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from decode_plan_check import generate_comparing  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """Limits measured (the suite fixes them), cached under tmp_path, none remembered from earlier tests."""
    monkeypatch.setenv(gemv_limits.ENV, "measure")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gemv_limits, "_LIMITS", {})
    return tmp_path / "cache" / "servescope" / gemv_limits.CACHE_NAME


def _bf16(n=96, k=64):
    w = torch.randn(n, k).to(torch.bfloat16)
    return w, cpu_linear.pack_for_onednn(w)


@pytest.mark.parametrize("times,limit", [
    ({2: (1.0, 2.0), 3: (1.5, 2.0), 4: (2.5, 2.0), 5: (1.0, 2.0)}, 3),  # the first loss ends it
    ({2: (2.1, 2.0)}, 1),
    ({2: (1.0, 1.0)}, 1),  # level: oneDNN (the GEMV must be MARGIN faster)
    ({2: (0.95, 1.0), 3: (0.96, 1.0)}, 2),
    ({}, 1),
])
def test_the_limit_is_the_last_row_count_before_onednn_wins(times, limit):
    assert gemv_limits.limit_from_times(times) == limit


def test_a_measured_limit_is_cached_and_read_back_without_timing(measuring):
    w, packed = _bf16()
    if packed is None:
        pytest.skip("no oneDNN bfloat16 here")
    assert gemv_limits.gemv_rows(w, packed, measure=lambda w: (5, {2: (1.0, 2.0)}, False)) == 5
    cache = json.loads(measuring.read_text())
    assert cache[gemv_limits.machine_key()]["96x64|bfloat16"]["rows"] == 5
    assert not list(measuring.parent.glob("*.tmp"))

    def never(w):
        raise AssertionError("timed again")
    gemv_limits._LIMITS.clear()
    assert gemv_limits.gemv_rows(w, packed, measure=never) == 5  # from the file
    assert gemv_limits.gemv_rows(w, packed, measure=never) == 5  # from the process
    assert gemv_limits.limits_in_use() == {"96x64|bfloat16": 5}


def test_a_limit_timed_on_a_busy_machine_serves_the_process_only(measuring):
    w, packed = _bf16()
    if packed is None:
        pytest.skip("no oneDNN bfloat16 here")
    assert gemv_limits.gemv_rows(w, packed, measure=lambda w: (4, {}, True)) == 4
    assert not measuring.exists()


def test_cached_only_reads_the_cache_and_times_nothing(measuring):
    w, packed = _bf16()
    if packed is None:
        pytest.skip("no oneDNN bfloat16 here")

    def never(w):
        raise AssertionError("timed")
    with gemv_limits.cached_only():  # nothing cached: the default, nothing timed, nothing remembered
        assert gemv_limits.gemv_rows(w, packed, measure=never) == cpu_linear.MAX_ROWS[torch.bfloat16]
    assert gemv_limits.gemv_rows(w, packed, measure=lambda w: (6, {}, False)) == 6  # timed outside, cached
    gemv_limits._LIMITS.clear()
    with gemv_limits.cached_only():
        assert gemv_limits.gemv_rows(w, packed, measure=never) == 6


def test_nothing_is_measured_where_there_is_no_choice(measuring, monkeypatch):
    def never(w):
        raise AssertionError("timed")
    w32 = torch.randn(32, 16)
    assert gemv_limits.gemv_rows(w32, cpu_linear.pack_for_onednn(w32), measure=never) == 1
    w, packed = _bf16()
    assert gemv_limits.gemv_rows(w, None, measure=never) == cpu_linear.MAX_ROWS[torch.bfloat16]
    monkeypatch.setenv(gemv_limits.ENV, "fixed")
    assert gemv_limits.gemv_rows(w, packed, measure=never) == cpu_linear.MAX_ROWS[torch.bfloat16]


def test_a_real_timing_gives_a_limit_from_its_own_times(monkeypatch):
    w, packed = _bf16(256, 128)
    if packed is None:
        pytest.skip("no oneDNN bfloat16 here")
    monkeypatch.setattr(gemv_limits, "PASS_BYTES", 1 << 20)
    rows, times, busy = gemv_limits.measure_limit(w, most=4)
    assert set(times) <= {2, 3, 4} and 2 in times
    assert all(g > 0 and o > 0 for g, o in times.values())
    assert rows == gemv_limits.limit_from_times(times) and 1 <= rows <= 4
    assert isinstance(busy, bool)


def test_the_decode_plan_follows_a_measured_limit_bit_for_bit(tmp_path, measuring, monkeypatch):
    """Every bfloat16 shape at 5 rows: the modules take the GEMV to 5 rows and oneDNN above, and the plan's steps
    are bit for bit the modules'."""
    from servescope import LLM, SamplingParams

    if cpu_linear.pack_for_onednn(torch.zeros(64, 64, dtype=torch.bfloat16)) is None:
        pytest.skip("no oneDNN bfloat16 here")
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False, head_dim=64,
                              num_hidden_layers=2)
    monkeypatch.setattr(gemv_limits, "measure_limit", lambda w, most=gemv_limits.MOST_ROWS: (5, {}, False))
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=64, max_model_len=128)
    linears = [m for m in llm.engine.model.modules() if hasattr(m, "gemv_rows") and m.weight.dtype == torch.bfloat16]
    assert linears and all(m.gemv_rows == 5 for m in linears)
    from servescope.measure.kernel_cache import gemv_limits_key  # (above the kernels: the table's cache key)

    key = gemv_limits_key(llm.engine.model)
    linears[-1].gemv_rows = 4
    assert gemv_limits_key(llm.engine.model) != key  # a table timed with other limits is timed again
    linears[-1].gemv_rows = 5
    m = linears[0]
    for rows, kernel in ((4, lambda x: cpu_linear.gemv(x, m.weight).to(x.dtype)),
                         (6, lambda x: cpu_linear.onednn_linear(x, m._packed, m.bias))):
        x = torch.randn(rows, m.weight.shape[1]).to(torch.bfloat16)
        assert torch.equal(m(x), kernel(x)), rows
    prompts = [[(i * 7 + j * 13) % 500 + 3 for i in range(3 + j)] for j in range(7)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for n in (4, 6):
        assert generate_comparing(llm, prompts[:n], sp) == {n: 4}
