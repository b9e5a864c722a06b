"""The step cost's cheaper passes give the numbers of their definitions: keys and reads in one pass over the rows,
the bound in one pass over the ops, op costs as immutable named tuples, kernel seconds only where a spec measured
rates (the simulator prices every distinct step shape through these)."""

import dataclasses
import random

import pytest

from servescope.analysis.cost_model import OpCost, StepCost, attended_keys, step_cost
from servescope.analysis.hardware import get_hardware
from servescope.analysis.op_counts import layer_keys, layer_keys_and_reads, layer_windows
from servescope.analysis.presets import load_preset


def _configs():
    mistral = load_preset("mistral-7b")
    return [load_preset("llama-3-8b"), dataclasses.replace(mistral, sliding_window=64),
            dataclasses.replace(mistral, sliding_window=64, layer_types=("sliding", "full") * 16)]


def _steps(rng: random.Random, n: int) -> list:
    steps = []
    for _ in range(n):
        rows = [(1, rng.randrange(0, 300)) for _ in range(rng.randrange(0, 20))]
        rows += [(rng.randrange(1, 200), rng.randrange(0, 300)) for _ in range(rng.randrange(0, 3))]
        steps.append(rows or [(1, 0)])
    return steps


@pytest.mark.parametrize("cfg", _configs(), ids=["full", "sliding", "hybrid"])
def test_keys_and_reads_in_one_pass_are_the_per_row_sums(cfg):
    for seqs in _steps(random.Random(0), 200):
        keys = sum(count * sum(attended_keys(n, c, w) for n, c in seqs) for w, count in layer_windows(cfg).items())
        reads = sum(count * sum(min(c, w) if w else c for _, c in seqs) for w, count in layer_windows(cfg).items())
        assert layer_keys_and_reads(cfg, seqs) == (keys, reads)
        assert (layer_keys(cfg, seqs), layer_keys(cfg, seqs, read_only=True)) == (keys, reads)


def test_the_bound_in_one_pass_is_the_two_sums():
    hw = get_hardware("h100")
    seen = set()
    for cfg in _configs():
        for seqs in _steps(random.Random(1), 100) + [[(4000, 0)], [(1, 100)] * 256]:
            cost = step_cost(cfg, seqs, hw)
            t_compute = sum(o.seconds for o in cost.ops if o.bound == "compute")
            t_memory = sum(o.seconds for o in cost.ops if o.bound == "memory")
            assert cost.bound == ("compute" if t_compute > t_memory else "memory")
            seen.add(cost.bound)
    assert seen == {"compute", "memory"}


def test_an_op_cost_is_immutable_and_reads_by_name():
    cost = step_cost(load_preset("llama-3-8b"), [(1, 10), (5, 0)], get_hardware("h100"))
    assert isinstance(cost, StepCost)
    op = cost.op("mlp")
    assert isinstance(op, OpCost) and op.name == "mlp" and op.bytes == op.to_dict()["bytes"]
    with pytest.raises(AttributeError):
        op.flops = 0.0


def test_kernel_seconds_only_on_a_spec_with_measured_rates():
    cfg, seqs = load_preset("llama-3-8b"), [(1, 100)] * 4
    datasheet = get_hardware("h100")
    assert all(o.kernel_seconds == 0.0 for o in step_cost(cfg, seqs, datasheet).ops)
    rated = dataclasses.replace(datasheet, linear_rates={"bfloat16": [[1, 1e9], [1024, 1e11]]})
    slow = step_cost(cfg, seqs, rated)
    assert all((o.kernel_seconds > 0) == (o.name in ("qkv_proj", "attn_out_proj", "mlp", "lm_head")) for o in slow.ops)
    assert slow.predicted_seconds > step_cost(cfg, seqs, datasheet).predicted_seconds
