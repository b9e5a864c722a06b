"""Sliding-window models equal transformers: a tiny random Mistral with a 16-token window (every layer) and a
Qwen2 with use_sliding_window / max_window_layers (one full layer, one windowed), prompts several windows
long: float32 logits through chunked prefill (chunks crossing window edges) and decode steps, greedy tokens;
and the same greedy tokens batched, chunked, with prefix caching and under preemption as one at a time."""

import os
import sys

import pytest
import torch

from helpers import (BATCHING_OVERRIDES, assert_batching_changes_nothing, assert_greedy_matches_transformers,
                     paged_logits)
from servescope import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402

TOL = 5e-4  # as test_parity.py
WINDOW = 16
MODELS = {"mistral": dict(sliding_window=WINDOW),
          "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def windowed(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = make_tiny_hf_model(tmp_path_factory.mktemp(family), family, **MODELS[family])
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return family, path, hf


def test_layer_kinds_follow_the_family(windowed):
    family, path, _ = windowed
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    kinds = [s.attention.kind for s in llm.engine.model_config.layer_specs()]
    assert kinds == (["sliding", "sliding"] if family == "mistral" else ["full", "sliding"])
    assert {s.attention.window for s in llm.engine.model_config.layer_specs() if s.attention.kind == "sliding"} == {16}


@pytest.mark.parametrize("chunk", [24, 7])
def test_logits_match_transformers(windowed, chunk):
    _, path, hf = windowed
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    ids = torch.randint(3, 49152, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = paged_logits(llm.engine, ids, chunk=chunk, decode_from=90)
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.2e}"
    # the window matters: full attention over the same weights is far from transformers' windowed logits
    full = LLM(model=str(_without_window(path)), num_kv_blocks=64, max_model_len=512)
    assert (paged_logits(full.engine, ids, chunk=chunk, decode_from=90) - ref).abs().max().item() > 100 * TOL


def _without_window(path):
    import json
    import shutil

    out = path.parent / (path.name + "-full")
    if not out.exists():
        shutil.copytree(path, out)
        cfg = json.loads((out / "config.json").read_text())
        for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"):
            cfg.pop(key, None)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_greedy_matches_transformers_generate(windowed):
    _, path, hf = windowed
    assert_greedy_matches_transformers(path, hf, 40)


@pytest.mark.parametrize("overrides", **BATCHING_OVERRIDES)
def test_batching_chunking_prefix_cache_preemption_change_nothing(windowed, overrides):
    assert_batching_changes_nothing(windowed[1], overrides, 12)


def test_bfloat16_paths_attend_over_the_window(windowed):
    """bfloat16 on the CPU sends every prefill token of a windowed layer through the paged kernel with the
    window: its logits stay near transformers' float32 ones, much nearer than full attention's."""
    _, path, hf = windowed
    ids = torch.randint(3, 49152, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    full = LLM(model=str(_without_window(path)), num_kv_blocks=64, max_model_len=512)
    full_diff = (paged_logits(full.engine, ids, chunk=24, decode_from=90) - ref).abs().max().item()
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512, dtype="bfloat16")
    for chunk in (24, None):
        diff = (paged_logits(llm.engine, ids, chunk=chunk, decode_from=90).float() - ref).abs().max().item()
        assert diff <= 0.05 and diff < full_diff / 4, (chunk, diff, full_diff)


def test_engine_gives_back_the_blocks_that_slid_out(windowed):
    """A windowed layer holds at most cdiv(window, S) + 1 blocks per decoding sequence: an all-windowed model's
    one table, and the windowed group's table of a model with a full layer (kvcache/hybrid.py: a table per group
    of layers), whose full group keeps them all. The tokens equal transformers' either way."""
    family, path, hf = windowed
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, block_size=4)
    ids = torch.randint(3, 49152, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = llm.engine
    km = engine.kv_manager
    groups = km.groups if km.num_groups > 1 else (km,)
    assert [g.window for g in groups] == ([WINDOW] if family == "mistral" else [0, WINDOW])
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        if engine.has_unfinished():
            held.append([g.num_held_blocks("r") for g in groups])
    for i, g in enumerate(groups):
        decoding = [h[i] for h in held[1:]]  # after the prefill step (the whole prompt's blocks go back next step)
        assert held[0][i] == 30 // 4 + 1 and max(decoding) <= (WINDOW // 4 + 1 if g.window else 90 // 4 + 1)
        assert (max(decoding) <= WINDOW // 4 + 1) == bool(g.window)
    km.check_invariants()
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False, min_new_tokens=60,
                           attention_mask=torch.ones(1, 30, dtype=torch.long))[0, 30:].tolist()
    assert out.token_ids == want


def test_a_prefix_hit_survives_the_eviction_of_blocks_out_of_view(windowed):
    """The windowed layers' blocks at the start of a cached prompt (the first to be evicted) are gone: a request
    with that prompt still hits it whole, the windowed tables take only the blocks in view, and the tokens equal
    transformers' (a kernel reading a block the hit did not take would be far off)."""
    from servescope.kvcache.prefix_cache import hash_full_blocks

    family, path, hf = windowed
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, block_size=4, enable_prefix_caching=True)
    engine, sp = llm.engine, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = torch.randint(3, 49152, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    llm.generate(ids, sp)
    km = engine.kv_manager
    groups = km.groups if km.num_groups > 1 else (km,)
    for g in groups:
        if g.window:  # evict the first 8 blocks of the prompt: what the LRU takes first
            for h in hash_full_blocks(ids, 4, limit=8):
                blk = g.prefix_cache.lookup(h)
                g.prefix_cache.take(blk)
                g.prefix_cache.uncache(blk)
                g.allocator.release(blk)
    km.check_invariants()
    hits = km.prefix_cache_hits
    prompt = ids + [11, 12, 13]
    out = llm.generate(prompt, sp)[0].outputs[0]
    assert km.prefix_cache_hits - hits == 60  # the whole prompt's 15 full blocks
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert out.token_ids == want
    km.check_invariants()
