"""The decode plan's check shared by its tests: every step the C++ plan serves also run through the modules."""

from __future__ import annotations

import torch


def generate_comparing(llm, prompts, sp) -> dict:
    """Greedy generation in which every forward pass the plan serves is also run through the module
    path (the model's own forward) on a copy of the KV cache; hidden states and caches must be equal.
    (Comparing two whole generations would not do: oneDNN's prefill GEMMs are not bitwise repeatable
    from run to run.) Returns the plan's calls by decode batch size."""
    ex = llm.engine.runner.executor
    plan, forward = ex.decode_plan, ex.forward
    run_layers = plan.run_layers
    calls: dict = {}

    def spy(h, *a):
        calls[h.shape[0]] = calls.get(h.shape[0], 0) + 1
        return run_layers(h, *a)

    def both(batch, kv_caches, backend):
        before = sum(calls.values())
        copies = [(k.clone(), v.clone()) for k, v in kv_caches]
        out = forward(batch, kv_caches, backend)
        if sum(calls.values()) > before:  # the plan ran: now the modules on the copy
            ref = ex.model(batch.input_ids, batch.positions, copies, batch.meta, backend)
            assert torch.equal(out, ref)
            for (k, v), (kr, vr) in zip(kv_caches, copies):
                assert torch.equal(k, kr) and torch.equal(v, vr)
        return out

    plan.run_layers = spy
    ex.forward = both
    try:
        llm.generate(prompts, sp)
    finally:
        del plan.run_layers
        del ex.forward
    return calls
