"""A KV cache with a block table per group of layers of one window (kvcache/hybrid.py) on tiny random Gemma 2,
Gemma 3, gpt-oss and Qwen2 (max_window_layers) checkpoints: each layer reads its own group's tables (float32
logits within tolerance of transformers when the groups' tables hold different blocks and the windowed ones have
given back what slid out), the engine builds one for hybrid models only, greedy outputs stay those of one
sequence at a time with the windowed pools smaller than the full one (batching, chunks across window edges,
prefix caching, preemption), the C++ decode plan's per-group runs equal the modules, and a fixed KV budget holds
more long sequences than one table for all layers, as the planner predicts."""

import os
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from helpers import assert_batching_changes_nothing, random_ids
from servescope import LLM
from servescope.analysis.kv_layout import group_blocks, kv_groups, layers_per_window, per_group_capacity
from servescope.engine import builder
from servescope.engine.model_runner import ModelRunner
from servescope.kvcache.hybrid import HybridKVCacheManager
from servescope.kvcache.manager import NO_BLOCK, KVCacheManager, cdiv
from servescope.model.attention.reference import TorchAttentionBackend

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402

WINDOW = 16
MODELS = {"gemma2": (dict(sliding_window=WINDOW, num_hidden_layers=2, attn_logit_softcapping=0.05,
                          final_logit_softcapping=2.0), 1e-4),
          "gemma3": (dict(sliding_window=WINDOW, num_hidden_layers=3, sliding_window_pattern=3), 1e-4),
          "gpt_oss": (dict(sliding_window=WINDOW), 1e-4),
          "qwen2": (dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1), 5e-4)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def hybrid(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = make_tiny_hf_model(tmp_path_factory.mktemp(family), family, **MODELS[family][0])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return family, path, hf


def grouped_logits(engine, ids, chunk, decode_from, backend=None):
    """Logits [len(ids), V] through a private cache with a table per group: the full group's blocks 0..n-1, each
    windowed group's other blocks of its pool (from the top, in reverse), NO_BLOCK where a block slid out of the
    window of the step's first query, as the KV manager hands them to the runner."""
    cfg, s = engine.model_config, engine.cache_config.block_size
    n = cdiv(len(ids), s)
    windows = sorted(layers_per_window(cfg))
    runner = ModelRunner(engine.executor.fork(), cfg, backend or engine.runner.backend, 2 * n, s, engine.kv_dtype,
                         engine.device, group_blocks={w: 2 * n for w in windows})
    req = SimpleNamespace(all_token_ids=list(ids))
    spans = [(p, min(chunk, decode_from - p)) for p in range(0, decode_from, chunk)]
    spans += [(i, 1) for i in range(decode_from, len(ids))]
    out = []
    with torch.inference_mode():
        for start, num in spans:
            tables = [list(range(n))] + [
                [NO_BLOCK if (i + 1) * s <= start - w + 1 else 2 * n - 1 - i for i in range(n)] for w in windows[1:]]
            seq = SimpleNamespace(request=req, num_computed_tokens=start, num_new_tokens=num, block_ids=tables[0],
                                  spec_token_ids=(), group_block_ids=tuple(tables))
            batch = runner.prepare([seq])
            assert sorted(batch.meta.window_groups) == windows[1:]
            out.append(runner.executor.compute_logits(runner.executor.forward(batch, runner.kv_caches,
                                                                              runner.backend)))
    return torch.cat(out)


@pytest.mark.parametrize("chunk", [24, 7])
@pytest.mark.parametrize("backend", ["engine", "reference"])
def test_each_layer_reads_its_groups_tables(hybrid, chunk, backend):
    family, path, hf = hybrid
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    ids = random_ids(120, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = grouped_logits(llm.engine, ids, chunk, 90, TorchAttentionBackend() if backend == "reference" else None)
    diff = (ours - ref).abs().max().item()
    assert diff <= MODELS[family][1], f"max |logit diff| {diff:.2e}"


def test_the_engine_keeps_a_table_per_group_for_hybrid_models_only(hybrid, tmp_path):
    family, path, _ = hybrid
    engine = LLM(model=str(path), num_kv_blocks=64, max_model_len=512, max_num_seqs=4,
                 max_num_batched_tokens=32).engine
    km = engine.kv_manager
    assert isinstance(km, HybridKVCacheManager) and km.windows == (0, WINDOW)
    layers = layers_per_window(engine.model_config)
    assert [g.num_blocks for g in km.groups] == [group_blocks(layers, 64, 16, 4, 1, 32)[w] for w in km.windows]
    assert km.groups[1].num_blocks < 64 < km.groups[0].num_blocks  # the windowed pool is sized by max_num_seqs
    assert [k.shape[0] for k, _ in engine.runner.kv_caches] == [
        km.groups[km.windows.index(s.attention.window)].num_blocks for s in engine.model_config.layer_specs()]
    assert engine.runner.kv_cache_bytes <= 64 * 16 * engine.kv_bytes_per_token  # the uniform cache's bytes
    state = engine.kv_cache_state()
    assert [g["window"] for g in state["groups"]] == [0, WINDOW] and state["capacity_tokens"] == km.num_blocks * 16
    if family == "qwen2":  # the same family with one kind of layer keeps one table, as before
        one = make_tiny_hf_model(tmp_path, "qwen2", sliding_window=WINDOW, use_sliding_window=True,
                                 max_window_layers=0)
        km = LLM(model=str(one), num_kv_blocks=64, max_model_len=512).engine.kv_manager
        assert type(km) is KVCacheManager and km.window == WINDOW


@pytest.mark.parametrize("overrides", [
    dict(max_num_seqs=4, max_num_batched_tokens=16),  # chunks of 16: every chunk edge a window edge ...
    dict(max_num_seqs=4, max_num_batched_tokens=24),  # ... and chunks across them
    # preemption: a budget this tight gives every group the uniform cache's 8 blocks (group_blocks' cap)
    dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=16),
    dict(max_num_seqs=4, speculative_method="ngram", num_speculative_tokens=3),  # verification rows per group
], ids=["chunk16", "chunk24", "preemption", "ngram"])
def test_batching_chunking_prefix_cache_preemption_change_nothing(hybrid, overrides):
    llm = assert_batching_changes_nothing(hybrid[1], overrides, 8)
    km = llm.engine.kv_manager
    assert isinstance(km, HybridKVCacheManager) and km.prefix_cache_hits > 0
    if "num_kv_blocks" not in overrides:
        assert km.groups[1].num_blocks < km.groups[0].num_blocks


def test_the_decode_plans_group_runs_equal_the_modules(hybrid):
    family, path, _ = hybrid
    engine = LLM(model=str(path), num_kv_blocks=64, max_model_len=512).engine
    ex = engine.executor
    plan = ex.decode_plan
    if plan is None:
        pytest.skip("the C++ decode plan covers these layers where the extension is built")
    windows = [s.attention.window for s in engine.model_config.layer_specs()]  # gpt-oss: windowed first
    assert set(windows) == {0, WINDOW}
    starts = [i for i in range(len(windows)) if i == 0 or windows[i] != windows[i - 1]]  # runs of one window
    runs = [(lo, hi, windows[lo]) for lo, hi in zip(starts, starts[1:] + [len(windows)])]
    assert [(lo, hi, w) for lo, hi, w, _ in plan.segments] == runs
    ids = random_ids(60, 2)
    by_plan = grouped_logits(engine, ids, 24, 40)  # decode steps from position 40: the plan's
    ex.decode_plan = None
    try:
        by_modules = grouped_logits(engine, ids, 24, 40)
    finally:
        ex.decode_plan = plan
    assert torch.equal(by_plan, by_modules)


def test_a_fixed_kv_budget_holds_more_long_sequences(tmp_path):
    """Gemma 3's shape (two windowed layers to one full): sequences of 450 tokens admitted into the engine's own
    KV manager, chunk by chunk as the scheduler does, until one no longer fits: one table for all layers holds
    num_blocks // 29 of them; a table per group holds the planner's per-group prediction."""
    path = make_tiny_hf_model(tmp_path, "gemma3", sliding_window=WINDOW, num_hidden_layers=3,
                              sliding_window_pattern=3)
    ctx, chunk, budget = 450, 64, 64
    cfg_kw = dict(model=str(path), num_kv_blocks=budget, max_model_len=512, max_num_batched_tokens=chunk)
    groups = kv_groups(LLM(**cfg_kw, max_num_seqs=1).engine.model_config, "float32", ctx, 16)
    predicted = per_group_capacity(groups, budget * 16 * sum(g.bytes_per_token for g in groups))
    with mock.patch.object(builder, "kv_group_blocks", lambda *a: None):  # one table for all layers
        before = _sequences_held(LLM(**cfg_kw, max_num_seqs=predicted).engine.kv_manager, ctx, chunk)
    after = _sequences_held(LLM(**cfg_kw, max_num_seqs=predicted).engine.kv_manager, ctx, chunk)
    assert before == budget // cdiv(ctx, 16) < after == predicted


def _sequences_held(km, ctx, chunk):
    held = 0
    while True:
        seq = SimpleNamespace(request_id=str(held), all_token_ids=list(range(held, held + ctx)), num_computed_tokens=0,
                              num_tokens=ctx)
        while seq.num_computed_tokens < ctx:
            n = min(chunk, ctx - seq.num_computed_tokens)
            if not km.allocate_slots(seq, n):
                km.check_invariants()
                return held
            seq.num_computed_tokens += n
        held += 1


def test_disable_hybrid_kv_cache_manager_keeps_one_table(hybrid):
    """vLLM's flag of the same name: one table for all layers, the layout a parallel engine keeps."""
    engine = LLM(model=str(hybrid[1]), num_kv_blocks=64, max_model_len=512,
                 disable_hybrid_kv_cache_manager=True).engine
    assert type(engine.kv_manager) is KVCacheManager and engine.kv_manager.num_blocks == 64
    assert {k.shape[0] for k, _ in engine.runner.kv_caches} == {64}


DRAFT = {"method": "draft", "num_speculative_tokens": 3, "adaptive": False}


@pytest.mark.parametrize("draft", ["self", "own"])
def test_a_draft_model_keeps_the_windowed_groups_freeing(tmp_path, draft):
    """Gemma 3's shape under draft-model speculation, prompts past the window, chunked, with prefix hits: greedy
    tokens those of one table and no speculation; the windowed group still holds at most cdiv(w + k, S) + 1
    blocks per decoding sequence (its window, a verification's 1 + k positions from the last token or the draft's
    lookahead) while the full group keeps every block. A self-draft reads the target's cache through each layer's
    own group's table; a draft given by path keeps its own cache over the full group's table (it attends over the
    whole context). Both are the target's weights unquantised: nearly every draft is accepted, which it could not
    be if the draft attended over wrong KV (the verification alone keeps the tokens right whatever it reads)."""
    from helpers import track_window_holdings
    from test_batching import PARAMS

    path = str(make_tiny_hf_model(tmp_path, "gemma3", sliding_window=WINDOW, num_hidden_layers=3,
                                  sliding_window_pattern=3))
    gen = torch.Generator().manual_seed(3)
    motif, shared = torch.randint(3, 49152, (6,), generator=gen).tolist(), random_ids(40, 7)
    prompts = [shared + motif * 5, shared + random_ids(30, 8), motif * 9]
    kw = dict(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)
    one = LLM(model=path, **kw, disable_hybrid_kv_cache_manager=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, PARAMS)]
    spec = {**DRAFT, **({"model": path} if draft == "own" else {})}
    llm = LLM(model=path, **kw, speculative=spec)
    km, engine = llm.engine.kv_manager, llm.engine
    assert isinstance(km, HybridKVCacheManager) and km.windows == (0, WINDOW)
    assert km.groups[1].num_blocks < 64 < km.groups[0].num_blocks
    most = track_window_holdings(km, 1 + 3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == want
    prop = engine.spec.proposer
    assert engine.spec.acceptance_rate > 0.95 and km.prefix_cache_hits > 0
    assert most[WINDOW] <= cdiv(WINDOW + 3, 16) + 1 < most[0]
    if draft == "self":
        assert prop.shares_target_kv and prop.runner.kv_caches is engine.runner.kv_caches
        assert prop.runner.group_windows == engine.runner.group_windows == (WINDOW,)
    else:
        assert not prop.shares_target_kv and prop.num_prefill_forwards > 0
        assert {k.shape[0] for k, _ in prop.runner.kv_caches} == {km.groups[0].num_blocks}
    km.check_invariants()
    assert km.num_used_blocks == 0
