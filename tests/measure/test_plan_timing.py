"""measure/decode_plan.py: the C++ decode plan's layers timed together beside the kernel table's sum of their
kernels (the table's decode_plan). Injected timings and a stand-in plan: deterministic, milliseconds."""

import pytest
import torch

from servescope.analysis.kernel_table import KernelTable, table_key
from servescope.analysis.op_counts import attended_keys
from servescope.config import ModelConfig
from servescope.measure import decode_plan

CFG = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 3,
                                "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
                                "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                "tie_word_embeddings": False})
LINEAR = {"qkv_proj": [[1, 1e-5], [8, 4e-5]], "o_proj": [[1, 5e-6], [8, 2e-5]], "gate_up_proj": [[1, 2e-5], [8, 6e-5]],
          "down_proj": [[1, 1e-5], [8, 3e-5]], "lm_head": [[1, 1e-4], [8, 2e-4]]}
PARTIAL = {"key": table_key(CFG, "float32", "float32", "float32"), "linear": LINEAR, "misc": [[1, 2e-6], [8, 6e-6]],
           "paged": {"fixed": 1e-6, "per_row": 2e-7, "per_key": 1e-9},
           "long": {"fixed": 1e-5, "per_row": 1e-6, "per_key": 2e-9}, "long_min_tokens": 2, "paged_max_context": 0}


class StandInPlan:
    """DecodePlanLayers' face: serves decode-only steps of up to max_rows rows (under inference mode, as the
    engine's steps run), records each run."""

    def __init__(self, max_rows: int):
        self.max_rows, self.runs = max_rows, []

    def serves(self, meta, num_tokens, kv_caches, backend) -> bool:
        return meta.is_decode_only and num_tokens <= self.max_rows and not torch.is_grad_enabled()

    def run_layers(self, h, residual, positions, kv_caches, meta, backend=None):
        self.runs.append((h.shape[0], positions.tolist(), meta.context_lens.tolist(), len(kv_caches)))
        return h, h


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(decode_plan, "DECODE_ROWS", (1, 2, 4, 8))
    monkeypatch.setattr(decode_plan, "DECODE_CONTEXT", 20)
    monkeypatch.setattr(decode_plan, "RUNS", 3)


def test_the_layers_are_priced_as_the_cost_model_prices_a_decode_step():
    table = KernelTable.from_dict(PARTIAL)
    L, rows, ctx = CFG.num_hidden_layers, 4, 20
    lin = sum(table.linear_seconds(p, rows) for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    want = L * (lin + table.paged.seconds(rows, rows * attended_keys(1, ctx)) + table.misc_seconds(rows))
    assert decode_plan.layers_seconds(CFG, table, rows, ctx) == pytest.approx(want)


def test_the_plan_is_timed_at_the_rows_it_serves_beside_the_tables_kernels(small, monkeypatch):
    plan_s = 3e-4  # about 1.4x what the table's kernels of those layers add up to
    monkeypatch.setattr(decode_plan, "_timed", lambda fn: fn() or plan_s)  # every run of the plan: plan_s
    plan = StandInPlan(max_rows=6)
    pts, rows = decode_plan.measure_decode_plan(plan, CFG, None, PARTIAL, torch.float32, torch.float32)
    table = KernelTable.from_dict(PARTIAL)
    assert [r for r, *_ in pts] == [1, 2, 4] and rows == 6  # 8 rows: the plan does not serve them
    assert all(p == [r, plan_s, pytest.approx(decode_plan.layers_seconds(CFG, table, r, 20))] for p in pts
               for r in [p[0]])
    # each row count: a warm-up and RUNS timed runs, every sequence at the context, one cache pair per layer
    assert [r[0] for r in plan.runs] == [1] * 4 + [2] * 4 + [4] * 4
    assert all(pos == [20] * n and ctx == [21] * n and caches == CFG.num_hidden_layers
               for n, pos, ctx, caches in plan.runs)
    # what the cost model makes of it: the plan's time less the host overhead per layer, over the kernels
    priced = KernelTable.from_dict({**PARTIAL, "decode_plan": pts, "decode_rows": rows})
    host = CFG.num_hidden_layers * 1e-5
    f = priced.layers_factor([(1, 20)] * 2, host)
    assert 1 < f < 2 and f == pytest.approx((plan_s - host) / pts[1][2])


def test_no_plan_or_a_plan_that_serves_no_step_gives_no_times(small, monkeypatch):
    monkeypatch.setattr(decode_plan, "_timed", lambda fn: fn() or 1.0)
    assert decode_plan.measure_decode_plan(None, CFG, None, PARTIAL, torch.float32, torch.float32) == ([], 0)
    assert decode_plan.measure_decode_plan(StandInPlan(0), CFG, None, PARTIAL, torch.float32, torch.float32) == ([], 0)
