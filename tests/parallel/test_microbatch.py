"""Pipeline micro-batches in one process: a step cut into micro-batches and run piece after piece
through the layers gives the whole step's hidden states and KV cache (a cut inside a prompt makes
two chunks of a chunked prefill), and rank 0 never cuts between a sequence and a later one whose
blocks it reads."""

from types import SimpleNamespace

import pytest
import torch

from servescope import LLM
from servescope.parallel.microbatch import choose_cuts, forbidden_spans, micro_batches
from tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("mb"), "llama", num_hidden_layers=3, with_tokenizer=False)
    llm = LLM(model=str(path), num_threads=1, num_kv_blocks=16, skip_tokenizer_init=True)
    return llm.engine.runner


def _seq(tokens, computed, new, blocks):
    return SimpleNamespace(request=SimpleNamespace(all_token_ids=tokens), num_computed_tokens=computed,
                           num_new_tokens=new, block_ids=blocks, spec_token_ids=())


def _caches(runner):
    return [(k.clone(), v.clone()) for k, v in runner.kv_caches]


@torch.inference_mode()
def test_micro_batches_equal_the_whole_step(runner):
    model, backend, s = runner.executor.model, runner.backend, runner.block_size
    a, b, c = list(range(3, 3 + 2 * s + 3)), list(range(50, 50 + 7)), list(range(90, 90 + 20))
    # two prompts prefilled first (so that the step's two decodes read a cache), then the step under
    # test: both decodes and a 20-token prompt
    runner.executor.forward(runner.prepare([_seq(a, 0, len(a) - 1, [0, 1, 2]), _seq(b, 0, len(b) - 1, [3])]),
                            runner.kv_caches, backend)
    step = runner.prepare([_seq(a, len(a) - 1, 1, [0, 1, 2]), _seq(b, len(b) - 1, 1, [3]),
                           _seq(c, 0, len(c), [4, 5])])
    base = _caches(runner)
    want = model(step.input_ids, step.positions, base, step.meta, backend)  # [T, Dm]
    for cuts in ([1], [2], [1, 9], [5, 12, 20]):  # after a decode, before the prompt, inside it
        kv = _caches(runner)
        pieces = micro_batches(step.input_ids, step.positions, step.meta, cuts)
        assert [(p.lo, p.hi) for p in pieces] == list(zip([0, *cuts], [*cuts, step.num_tokens]))
        outs = [model.run_layers(model.embed(p.input_ids), None, p.positions, kv, p.meta, backend)
                for p in pieces]
        got = model.final_norm(torch.cat([h for h, _ in outs]), torch.cat([r for _, r in outs]))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for (k, v), (k0, v0) in zip(kv, base):
            torch.testing.assert_close(k, k0, rtol=0, atol=1e-6)
            torch.testing.assert_close(v, v0, rtol=0, atol=1e-6)
    # a piece of the prompt is a chunk: its context ends at its last token, the decodes stay decodes
    first, second = micro_batches(step.input_ids, step.positions, step.meta, [9])
    assert first.meta.query_lens_cpu == [1, 1, 7] and first.meta.context_lens_cpu == [len(a), len(b), 7]
    assert first.meta.num_decode_seqs == 2 and second.meta.num_decode_seqs == 0
    assert second.meta.query_lens_cpu == [13] and second.meta.context_lens_cpu == [20]


def test_no_cut_between_a_reader_and_a_later_writer_of_its_block(runner):
    s = runner.block_size
    toks = list(range(2 * s + 1))
    # sequence 0 (a decode) reads block 5, which sequence 1's prompt chunk writes in the same step
    hazard = runner.prepare([_seq(toks, s, 1, [5, 6]), _seq(toks, 0, s, [5])])
    assert forbidden_spans(hazard.meta, s) == ((0, s + 1),)
    assert choose_cuts(hazard.meta, 2, s) == []  # every cut would split them: one micro-batch
    safe = runner.prepare([_seq(toks, s, 1, [5, 6]), _seq(toks, 0, s, [7])])
    assert forbidden_spans(safe.meta, s) == ()
    assert choose_cuts(safe.meta, 2, s) == [round((s + 1) / 2)]  # the middle of the 1 + s tokens


@torch.inference_mode()
def test_stage_decode_plans_chained_equal_the_whole_plan(runner):
    """A pipeline stage's C++ decode plan over its own layers (DecodePlan.run_layers, from the
    previous stage's (h, residual)): two stages chained give the one-process plan's output bit for bit."""
    from servescope.kernels.cpu import ops as cpu_ops
    from servescope.model.transforms import cpu_decode_plan

    ex = runner.executor
    if not cpu_ops.available() or ex.decode_plan is None:
        pytest.skip("CPU op extension not built here")
    model, s = ex.model, runner.block_size
    layers = model.model.layers
    stages = []
    try:
        for part in (slice(0, 2), slice(2, 3)):
            model.model.layers = torch.nn.ModuleList(layers[part])
            stages.append(cpu_decode_plan(model))
    finally:
        model.model.layers = layers
    a, b = list(range(5, 5 + s + 2)), list(range(70, 79))
    runner.executor.forward(runner.prepare([_seq(a, 0, len(a) - 1, [8, 9]), _seq(b, 0, len(b) - 1, [10])]),
                            runner.kv_caches, runner.backend)
    step = runner.prepare([_seq(a, len(a) - 1, 1, [8, 9]), _seq(b, len(b) - 1, 1, [10])])
    m = step.meta
    h0, pos = model.embed(step.input_ids), step.positions
    whole_kv, staged_kv = _caches(runner), _caches(runner)
    want = model.final_norm(*ex.decode_plan.run_layers(h0, None, pos, whole_kv, m))
    h, r = stages[0].run_layers(h0, None, pos, staged_kv[:2], m)
    h, r = stages[1].run_layers(h, r, pos, staged_kv[2:], m)
    assert torch.equal(model.final_norm(h, r), want)
    assert all(torch.equal(x, y) for (k, v), (k2, v2) in zip(whole_kv, staged_kv) for x, y in ((k, k2), (v, v2)))


def test_a_further_groups_reader_and_writer_are_not_cut_apart(runner):
    """A cache with a table per group of layers: a hazard in a further group's tables forbids the cut as one in
    the first group's does (ModelRunner lays each group's slots and tables in the step; the metadata is the
    runner's of a model whose groups are the first's windows plus one)."""
    from servescope.engine.model_runner import ModelRunner

    s = runner.block_size
    grouped = ModelRunner(runner.executor, runner.cfg, runner.backend, 16, s, runner.kv_dtype, runner.device,
                          kv_caches=runner.kv_caches, group_blocks={0: 16, 8: 16})
    toks = list(range(2 * s + 1))

    def seq(computed, new, first, further):
        return SimpleNamespace(**vars(_seq(toks, computed, new, first)), group_block_ids=(first, further))

    # the first group's tables share nothing; in the further group sequence 0 reads block 3, which 1 writes
    batch = grouped.prepare([seq(s, 1, [5, 6], [3, 4]), seq(0, s, [7], [3])])
    assert forbidden_spans(batch.meta, s) == ((0, s + 1),) and choose_cuts(batch.meta, 2, s) == []
    piece = micro_batches(batch.input_ids, batch.positions, batch.meta, [1])[1]  # each group's rows sliced
    assert piece.meta.for_window(8).block_tables.tolist() == [[3, 0]]  # (rows padded to the step's widest)
    assert piece.meta.for_window(8).slot_mapping.tolist() == [3 * s + p for p in range(s)]
