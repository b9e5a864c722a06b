"""Speculation, a stage of the engine builder: the token decider an EngineConfig asks for (plain
sampling, or speculative decoding with its proposer and k chooser) and, for draft-model speculation,
the draft's weights (a second LoadedModel, engine/weights.py) checked against the target, with a
ModelRunner over the target's block geometry (spec/draft.py: the draft reads and writes through the
target's block tables): on the target's own KV cache for self-speculation (a table per group of layers:
each layer its group's), else on a cache of its own over the first group's table (full attention)."""

from __future__ import annotations

import logging
from typing import Optional

from servescope.config import EngineConfig, ParallelConfig, SpeculativeConfig
from servescope.engine.model_runner import ModelRunner
from servescope.engine.spec_decode import SpecDecoder
from servescope.engine.step_cost import StepCostPredictor
from servescope.engine.token_decider import TokenDecider
from servescope.engine.weights import load_model, resolve_device, resolve_dtypes
from servescope.errors import EngineConfigError
from servescope.model.quantize import weight_format
from servescope.spec.adaptive import KChooser
from servescope.spec.draft import DraftProposer
from servescope.spec.ngram import NgramProposer

logger = logging.getLogger(__name__)


def build_token_decider(config: EngineConfig, loaded, runner, sampler, cost: Optional[StepCostPredictor],
                        max_model_len: int) -> TokenDecider:
    spec = config.speculative
    if not spec.enabled:
        return TokenDecider(sampler)
    draft_cost = None
    if spec.speculative_method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)  # host work of microseconds
    else:
        proposer, draft_cost = build_draft_proposer(config, loaded, runner, sampler, max_model_len, cost)
    step_seconds = draft_step_seconds = None
    if cost is not None:
        step_seconds = _decode_rows_seconds(cost)
    if cost is not None and draft_cost is not None:
        draft_step_seconds = _decode_rows_seconds(draft_cost)
    chooser = KChooser(spec.num_speculative_tokens, spec.speculative_adaptive, step_seconds, draft_step_seconds)
    return SpecDecoder(proposer, chooser, sampler, max_model_len)


def _decode_rows_seconds(cost: StepCostPredictor):
    """(rows, context_len) -> the predicted step over that many one-token rows (logits at each)."""
    def seconds(rows: int, context_len: int) -> float:
        return cost.predict([(1, context_len)] * rows, num_logits=rows).predicted_seconds
    return seconds


def build_draft_proposer(config: EngineConfig, loaded, runner: ModelRunner, sampler, max_model_len: int,
                         target_cost: Optional[StepCostPredictor]) -> tuple:
    """(the DraftProposer, a StepCostPredictor for its forwards or None when the engine predicts nothing).
    The draft's weights are a second LoadedModel (engine/weights.py), never sharded."""
    spec = config.speculative
    # the draft runs in this process whatever the target's layout (a parallel target's rank 0: the draft keeps
    # its own cache over the target's first table, as the scheduler hands it out)
    draft_config = config.replace(model=spec.speculative_model or config.load.model,
                                  quantization=spec.speculative_quantization, speculative=SpeculativeConfig(),
                                  parallel=ParallelConfig())
    device = resolve_device(draft_config)
    dtype, kv_dtype = resolve_dtypes(draft_config, device)
    draft = load_model(draft_config, device, dtype)  # no worker entry point: a draft is never parallel
    check_draft(draft, loaded, max_model_len)
    shared = shares_target_kv(spec, draft.model_config, loaded.model_config, kv_dtype, runner)
    if shared:  # the target's cache, each layer through its own group's table
        draft_runner = ModelRunner(draft.executor, draft.model_config, runner.backend, runner.num_blocks,
                                   runner.block_size, kv_dtype, device, kv_caches=runner.kv_caches,
                                   group_blocks=runner.group_blocks)
    else:  # a cache of its own over the first group's table (the full-attention group's: every block)
        draft_runner = ModelRunner(draft.executor, draft.model_config, runner.backend, runner.table_blocks,
                                   runner.block_size, kv_dtype, device)
    logger.info("draft model %s (%s): %d layers, %.1f MiB of weights, %s",
                draft.source_path, spec.speculative_quantization or "unquantised",
                draft.model_config.num_hidden_layers, draft.executor.weight_bytes / 2**20,
                "reads the target's KV cache" if shared
                else f"{draft_runner.kv_cache_bytes / 2**20:.1f} MiB of KV cache")
    cost = None
    if target_cost is not None:  # on the target's hardware
        cost = StepCostPredictor(draft.model_config, target_cost.hw, None, dtype, kv_dtype,
                                 spec.speculative_quantization,
                                 weight_format=weight_format(draft.executor.model, spec.speculative_quantization))
    return DraftProposer(draft_runner, sampler, shares_target_kv=shared), cost


def shares_target_kv(spec: SpeculativeConfig, draft_cfg, target_cfg, kv_dtype, runner: ModelRunner) -> bool:
    """Self-speculation (the draft is the target's own weights, quantised or not) reads the target's KV
    cache (spec/draft.py) when the layers' KV shapes and the KV dtype are the same, which they are unless
    the target's cache is sharded (a parallel executor's workers hold it)."""
    same_shape = all(getattr(draft_cfg, a) == getattr(target_cfg, a)
                     for a in ("num_hidden_layers", "num_key_value_heads", "head_dim"))
    same_shape = same_shape and tuple(s.attention.window for s in draft_cfg.layer_specs()) == runner.layer_windows
    return (spec.speculative_model is None and same_shape and kv_dtype == runner.kv_dtype
            and len(runner.kv_caches) == draft_cfg.num_hidden_layers
            and runner.executor.shard_config(target_cfg) == target_cfg)


def check_draft(draft, target, max_model_len: int) -> None:
    """The draft must speak the target's vocabulary and hold the target's whole context."""
    dv, tv = draft.model_config.vocab_size, target.model_config.vocab_size
    if dv != tv:
        raise EngineConfigError(f"the draft model {draft.source_path} has a vocabulary of {dv} tokens, the target "
                                f"{target.source_path} one of {tv}: a draft must share the target's tokenizer")
    dt, tt = draft.tokenizer, target.tokenizer
    if dt is not None and tt is not None and dt.vocab_size != tt.vocab_size:
        raise EngineConfigError(f"the draft's tokenizer has {dt.vocab_size} tokens, the target's {tt.vocab_size}: "
                                f"a draft must share the target's tokenizer")
    if dt is not None and tt is not None:
        probe = "The quick brown fox, 12345 — naïve café."
        if dt.encode(probe) != tt.encode(probe):
            raise EngineConfigError("the draft's tokenizer encodes text differently from the target's: a draft "
                                    "must share the target's tokenizer")
    ctx = draft.model_config.max_position_embeddings
    if ctx < max_model_len:
        raise EngineConfigError(f"the draft model's context is {ctx} tokens, shorter than the target's "
                                f"max_model_len {max_model_len}: set max_model_len <= {ctx} or use another draft")
