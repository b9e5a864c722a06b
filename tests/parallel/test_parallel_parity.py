"""Tensor parallel (TP=2) and pipeline parallel (PP=2) on two gloo processes, one thread each: greedy
tokens identical to one process and logits within 1e-4 at every step, for every family of the parity
tests, with batching, chunked prefill, prefix caching and preemption in the workload."""

from pathlib import Path

import pytest

from helpers_parallel import assert_same_as_single_process
from servescope.errors import EngineConfigError
from tiny_models import make_tiny_hf_model

TP_CASES = {
    "llama": {},  # llama3 rope scaling, untied head
    "llama_plain": {},  # tied embeddings: the head shares the vocabulary-parallel embedding's shard
    "mistral": {},
    "qwen2": {},  # q/k/v biases, sharded with their heads
    "qwen3": {},  # per-head q/k norms
    # one KV head < TP=2: each shard holds a replica of it (MQA; GQA with Hkv < T, as vLLM does)
    "llama-mqa": dict(num_key_value_heads=1),
    # a vocabulary that TP=2 does not divide: the last shard is padded
    "qwen2-odd-vocab": dict(vocab_size=49153),
    # windows under the workload's 100-token prompt: all layers (Mistral; 64, so that the blocks it still holds
    # make the workload preempt), every other one with soft-capped scores and logits (Gemma 2), two local
    # layers with their own rotary base to one global (Gemma 3)
    "mistral-window": dict(sliding_window=64),
    "gemma2-window": dict(sliding_window=16, attn_logit_softcapping=0.05, final_logit_softcapping=2.0),
    "gemma3-window": dict(sliding_window=16, num_hidden_layers=3, sliding_window_pattern=3),
    # latent attention: heads of the query, kv_b_proj and o_proj per shard, the latent cache whole on both; a dense
    # first layer, then experts sharded inside each (the shared experts like a dense MLP); V3 with the query LoRA
    "deepseek_v2": {},
    "deepseek_v3": {},
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_2_equals_one_process(tmp_path, case):
    family = case.split("-")[0]
    path = str(make_tiny_hf_model(tmp_path, family, **TP_CASES[case]))
    # windowed layers: a block table per group of layers (kvcache/hybrid.py), the engine's default
    common = dict(disable_hybrid_kv_cache_manager=False) if "window" in case else None
    assert_same_as_single_process(path, common, tensor_parallel_size=2)


def test_tensor_parallel_2_with_an_int8_kv_cache_equals_one_process(tmp_path):
    """Each shard holds whole KV heads, so its rows and their per-token-per-head scales are the single
    process's: an int8 KV cache changes nothing under TP."""
    path = str(make_tiny_hf_model(tmp_path, "llama"))
    assert_same_as_single_process(path, common=dict(kv_cache_dtype="int8"), tensor_parallel_size=2)


@pytest.mark.parametrize("family, overrides, micro_batches", [
    ("llama", dict(num_hidden_layers=3), 0),  # untied; an uneven split (2 + 1 layers)
    ("llama_plain", {}, 0),  # tied: the last stage keeps the embedding's weight as its head
    ("mistral", {}, 0),
    ("qwen2", {}, 0),
    ("qwen3", {}, 0),
    ("deepseek_v2", dict(num_hidden_layers=3), 0),  # latent attention and experts in both stages
    ("llama", dict(num_hidden_layers=3), 3),  # every step cut in 3, decode steps of 2-4 sequences too
    ("llama", dict(num_hidden_layers=3), 1),  # never cut: the stages one after another
])
def test_pipeline_parallel_2_equals_one_process(tmp_path, family, overrides, micro_batches):
    """Micro-batches (auto: P of them for a step of >= 16 prefill tokens, so the prefill and mixed steps) cut
    inside prompts and between sequences; tokens and logits stay those of one process."""
    path = str(make_tiny_hf_model(tmp_path, family, **overrides))
    recs = assert_same_as_single_process(path, pipeline_parallel_size=2, pipeline_micro_batches=micro_batches)
    cut = [r.pipeline_micro_batches for r in recs]
    if micro_batches == 1:
        assert set(cut) == {1}
    else:
        assert max(cut) == (micro_batches or 2)
        assert micro_batches or min(cut) == 1  # auto: a decode-only step stays whole
        # a cut prefill step: some record has prefill tokens split over micro-batches
        assert any(r.num_prefill_tokens >= 16 and r.pipeline_micro_batches > 1 for r in recs)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tensor_parallel_2_with_speculation_equals_one_process(tmp_path, method):
    """Verification rows (1 + k one-token rows per speculating request) go to the workers like any
    step's rows: n-gram speculation at TP=2 keeps the single process's greedy tokens, and so does a draft
    model (the target's weights, whole in rank 0's process on a cache of its own)."""
    from servescope import LLM
    from helpers_parallel import ENGINE, PARAMS

    path = str(make_tiny_hf_model(tmp_path, "llama"))
    prompts = [[5, 6, 7, 8, 9, 10] * 6, [100, 200, 300, 100, 200]]
    want = [o.outputs[0].token_ids for o in LLM(model=path, **ENGINE).generate(prompts, PARAMS)]
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=path, **ENGINE, tensor_parallel_size=2, speculative=spec)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
        drafted, rate = llm.engine.spec.num_draft_tokens, llm.engine.spec.acceptance_rate
    finally:
        llm.engine.shutdown(keep_workers=True)
    assert got == want and drafted > 0
    assert method == "ngram" or rate > 0.9  # the target's own weights: its drafts are the target's tokens


def test_tensor_parallel_keeps_a_block_table_per_group_of_layers(tmp_path):
    """Gemma 3's local and global layers at TP=2: rank 0 keeps the hybrid manager's table per group (the step
    plan carries every group's slots and table to the workers), so a windowed group's pool holds only its window
    per sequence, as in one process; the windowed parity cases above run this layout through the workload."""
    from servescope import LLM
    from helpers_parallel import ENGINE
    from servescope.kvcache.hybrid import HybridKVCacheManager

    path = str(make_tiny_hf_model(tmp_path, "gemma3", **TP_CASES["gemma3-window"]))
    kw = {**ENGINE, "disable_hybrid_kv_cache_manager": False}
    one = LLM(model=path, **kw)
    llm = LLM(model=path, **kw, tensor_parallel_size=2)
    try:
        assert isinstance(llm.engine.kv_manager, HybridKVCacheManager)
        assert llm.engine.kv_manager.group_stats() == one.engine.kv_manager.group_stats()
    finally:
        llm.engine.shutdown(keep_workers=True)


@pytest.mark.parametrize("family, overrides", [
    ("gpt_oss", dict(sliding_window=16)),  # a windowed stage and a full one; sinks, experts in both
    ("gemma2", dict(sliding_window=16, num_hidden_layers=4)),  # both kinds in each stage
])
def test_pipeline_parallel_2_with_a_table_per_group_equals_one_process(tmp_path, family, overrides):
    from servescope.kvcache.hybrid import HybridKVCacheManager

    def tables_per_group(llm):
        assert isinstance(llm.engine.kv_manager, HybridKVCacheManager)

    path = str(make_tiny_hf_model(tmp_path, family, **overrides))
    assert_same_as_single_process(path, dict(disable_hybrid_kv_cache_manager=False), pipeline_parallel_size=2,
                                  on_engine=tables_per_group)


def test_pipeline_parallel_keeps_a_block_table_per_group_of_layers(tmp_path):
    """Gemma 3's shape (two local layers to one global) at PP=2: stage 0 holds the local layers only, stage 1 the
    global one. Rank 0 keeps the hybrid manager's table per group, the plan carries every group's, each stage
    allocates the pools of its own layers' groups and its layers read their group's (micro-batches cut them too):
    over the workload (chunks, prefix hits, preemption) the tokens and logits of one process, and the windowed
    group holds at most cdiv(w, S) + 1 blocks per decoding sequence while the full group keeps every block.
    Then with room to spare and a draft model (on rank 0, its own cache over the full group's table): the windowed
    pool smaller than the full one, which holds what stage 1's one full layer had before (a stage cannot lend its
    windowed layers' saved bytes to another stage), greedy tokens those of one process without speculation,
    nearly every draft of the target's own weights accepted, the windowed group at most cdiv(w + k, S) + 1
    blocks per decoding sequence (a verification's 1 + k positions from the last token, the draft's lookahead)."""
    import sys
    from servescope import LLM
    from helpers_parallel import ENGINE, PARAMS, ROUND_1, ROUND_2
    from servescope.kvcache.hybrid import HybridKVCacheManager
    from servescope.kvcache.manager import cdiv

    sys.path.insert(0, str(Path(__file__).parent.parent / "engine"))
    from helpers import track_window_holdings

    path = str(make_tiny_hf_model(tmp_path, "gemma3", **TP_CASES["gemma3-window"]))
    most = []
    assert_same_as_single_process(path, dict(disable_hybrid_kv_cache_manager=False), pipeline_parallel_size=2,
                                  on_engine=lambda llm: most.append(track_window_holdings(llm.engine.kv_manager, 1)))
    assert most[0] == most[1] and most[1][16] <= cdiv(16, 16) + 1 < most[1][0]
    kw = {**ENGINE, "disable_hybrid_kv_cache_manager": False, "num_kv_blocks": 40, "max_num_seqs": 2}
    one = LLM(model=path, **kw)
    want = [o.outputs[0].token_ids for r in (ROUND_1, ROUND_2) for o in one.generate(r, PARAMS)]
    k = 3
    llm = LLM(model=path, **kw, pipeline_parallel_size=2,
              speculative={"method": "draft", "num_speculative_tokens": k, "adaptive": False})
    try:
        km = llm.engine.kv_manager
        assert isinstance(km, HybridKVCacheManager)
        pools = {g["window"]: g["num_blocks"] for g in km.group_stats()}
        assert pools[16] < pools[0] == 40  # stage 1: its one full layer in 40 blocks' bytes of one layer
        assert [c.shape[0] for c, _ in llm.engine.runner.kv_caches] == [pools[16]] * 2  # stage 0: local layers
        most = track_window_holdings(km, 1 + k)
        assert [o.outputs[0].token_ids for r in (ROUND_1, ROUND_2) for o in llm.generate(r, PARAMS)] == want
        assert llm.engine.spec.acceptance_rate > 0.95 and km.prefix_cache_hits > 0
        assert most[16] <= cdiv(16 + k, 16) + 1 < most[0]
        draft = llm.engine.spec.proposer.runner
        assert {c.shape[0] for c, _ in draft.kv_caches} == {pools[0]} and len(draft.kv_caches) == 3
    finally:
        llm.engine.shutdown(keep_workers=True)


@pytest.mark.parametrize("family, qtype, parallel", [
    ("llama", "Q4_0", dict(tensor_parallel_size=2)),  # untied: the file's output blocks cut by vocabulary rows
    ("llama_plain", "Q8_0", dict(tensor_parallel_size=2)),  # tied: one slice of token_embd is both tables
    ("llama", "Q4_1", dict(tensor_parallel_size=2)),  # asymmetric blocks: their offsets cut with their scales
    ("llama", "Q4_0", dict(pipeline_parallel_size=2)),  # stages keep their layers' blocks whole
])
def test_packed_gguf_blocks_under_tensor_and_pipeline_parallelism(tmp_path, family, qtype, parallel):
    """--quantization gguf keeps a llama.cpp file's blocks: TP cuts them (qkv and gate|up by output rows, o and
    down by whole 32-blocks of input columns, the vocabulary by rows), PP keeps each stage's. Greedy tokens equal
    one process's. The logits: within 1e-4 at nine steps in ten, within 0.05 at all: a row-parallel all-reduce
    adds the partial sums in another order (~1e-7), which can move an activation across an int8 rounding
    boundary in the next layer's group-32 product (the activations are rounded to int8 per block, as llama.cpp
    does): a change of about one activation quantum there."""
    import gguf
    from tiny_gguf import write_tiny_gguf

    from servescope.loader.source import load_model_source

    src = load_model_source(str(make_tiny_hf_model(tmp_path, family, with_tokenizer=False, num_hidden_layers=3)))
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, qtype=gguf.GGMLQuantizationType[qtype])
    tol = 0.05 if "tensor_parallel_size" in parallel else 1e-4
    assert_same_as_single_process(path, dict(quantization="gguf", skip_tokenizer_init=True), logit_tol=tol,
                                  **parallel)


def test_packed_gguf_blocks_that_a_shard_would_cut_are_refused(tmp_path):
    """A row-parallel cut that falls inside a block is refused, naming the projection and the block size."""
    import gguf
    from tiny_gguf import write_tiny_gguf

    from servescope import LLM
    from servescope.errors import WorkerFailedError
    from servescope.loader.source import load_model_source

    src = load_model_source(str(make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False, intermediate_size=96)))
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, qtype=gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises((EngineConfigError, WorkerFailedError), match="down_proj's packed input columns at 0..48"):
        LLM(model=path, quantization="gguf", skip_tokenizer_init=True, tensor_parallel_size=2, num_threads=1,
            num_kv_blocks=8)
