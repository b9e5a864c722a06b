"""LLMEngine: add requests, step, get incremental outputs. The only glue between the layers.

One step:
  Scheduler.schedule()              -> SchedulerOutput (which requests, how many tokens each)
  ModelRunner.execute()             -> logits of each request whose next token is due
  Sampler                           -> one token per such request
  Scheduler.update_from_output()    -> KV positions advance, tokens appended
  OutputProcessor                   -> detokenise, stop checks, logprobs, request metrics, finish
                                       (freeing blocks), RequestOutputs
and a StepRecord of the step (with the cost model's prediction).

The engine is built from an EngineConfig by engine/builder.py; `with_config` builds another on the
same weights.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Optional, Sequence, Union

import torch

from servescope.config import EngineConfig, SamplingParams
from servescope.engine.builder import EngineParts, build_engine
from servescope.engine.output_processor import OutputProcessor
from servescope.engine.prompt_scoring import plan_prompt_spans, record_prompt_logprobs
from servescope.errors import InvalidParameterError
from servescope.sampling.sampler import SamplingState, make_generator
from servescope.scheduler.output import SchedulerOutput
from servescope.scheduler.request import Request
from servescope.telemetry.moe import record_expert_parallel, record_routing
from servescope.telemetry.step_record import StepRecord, kv_bytes_used

STEP_HISTORY = 100_000  # step records kept in memory (a few hundred bytes each)


class LLMEngine:
    """One model's engine: `add_request`, then `step` until `has_unfinished` is false. Not thread-safe
    (AsyncEngine drives it from one thread). Built from an EngineConfig or its flat keyword arguments."""

    def __init__(self, config: Optional[EngineConfig] = None, *, hardware_spec=None, **kwargs):
        """hardware_spec: the analysis.HardwareSpec to predict steps on, resolved by the caller
        (measure.hardware_for_config runs the full probe); None: engine/hardware.default_hardware."""
        self._adopt(build_engine(config or EngineConfig(**kwargs), hardware=hardware_spec))

    @classmethod
    def from_parts(cls, parts: EngineParts) -> "LLMEngine":
        """An engine on parts made by engine/builder.py."""
        engine = cls.__new__(cls)
        engine._adopt(parts)
        return engine

    def _adopt(self, parts: EngineParts) -> None:
        self.config = parts.config
        self.loaded = loaded = parts.loaded
        self.executor = parts.runner.executor
        self.model = self.executor.model
        self.model_config, self.tokenizer, self.source_path = loaded.model_config, loaded.tokenizer, loaded.source_path
        self.load_seconds, self.weight_bytes = loaded.load_seconds, loaded.executor.weight_bytes
        self.device, self.dtype, self.kv_dtype = parts.device, parts.dtype, parts.kv_dtype
        self.max_model_len, self.kv_bytes_per_token = parts.max_model_len, parts.kv_bytes_per_token
        self.cache_config, self.scheduler_config = parts.cache_config, parts.scheduler_config
        self.runner, self.kv_manager, self.scheduler = parts.runner, parts.kv_manager, parts.scheduler
        self.sampler, self.eos_token_ids = parts.sampler, loaded.eos_token_ids
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       self.scheduler.finish_request)
        # the no-KV-cache baseline: each step's KV is dropped, so the next step recomputes it all
        self.recompute_kv = parts.config.cache.no_kv_cache
        self.step_records: collections.deque = collections.deque(maxlen=STEP_HISTORY)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self._step_counter = 0
        self._grammars = None  # a structured.GrammarCompiler, built on the first structured request
        self._cost = parts.cost
        self.decider = parts.decider  # engine/token_decider.py: plain sampling or speculative verification
        self.start_time = time.perf_counter()

    def with_config(self, hardware_spec=None, **overrides) -> "LLMEngine":
        """A new engine on the same weights with other settings (KV size, chunking, caching...), given
        as EngineConfig's flat names. Weight-changing settings (model, dtype, device, quantization)
        must stay the same. `engine.with_config(**config.flat())` builds `config` on these weights.
        hardware_spec: as for LLMEngine; None keeps this engine's unless the hardware name changes."""
        config = self.config.replace(**overrides)
        if hardware_spec is None and config.telemetry.hardware == self.config.telemetry.hardware:
            hardware_spec = self.hardware
        return LLMEngine.from_parts(build_engine(config, shared=self.loaded, hardware=hardware_spec))

    @property
    def spec(self):
        """The SpecDecoder (engine/spec_decode.py) when speculative decoding is on, else None."""
        return self.decider if self.decider.speculative else None

    @property
    def hardware(self):
        """The HardwareSpec the steps are predicted on (None when prediction is off)."""
        return self._cost.hw if self._cost is not None else None

    @property
    def step_cost_predictor(self):
        """The cost model that annotates each StepRecord (None when prediction is off)."""
        return self._cost

    @property
    def gpu_linear_choice(self) -> dict:
        return self.executor.gpu_linear_choice

    def set_gpu_linear(self, mode: str) -> dict:
        """Switch the decode matmuls of a running CUDA engine to `mode` (cublas | triton | auto, as
        EngineConfig.gpu_linear) and capture the CUDA graphs again, since they hold the kernels of
        the moment. Returns the choice per (N, K, M). The engine must be idle."""
        if self.has_unfinished():
            raise RuntimeError("set_gpu_linear needs an idle engine")
        return self.executor.set_gpu_linear(mode, self.runner)

    def shutdown(self, keep_workers: bool = False) -> None:
        """Stop what the engine started (a parallel engine's worker processes); idempotent.
        keep_workers: park healthy workers for the next parallel engine of the same size in this
        process, which then loads its weights into them instead of starting processes."""
        self.executor.shutdown(keep_workers)

    @property
    def grammar_compiler(self):
        """Compiles structured-output constraints for this tokenizer (thread-safe, cached)."""
        if self._grammars is None:
            try:
                from servescope.structured import GrammarCompiler  # optional dependency (xgrammar)
            except ImportError as e:
                raise InvalidParameterError("structured", f"structured outputs need xgrammar ({e})") from None
            if self.tokenizer is None:
                raise InvalidParameterError("structured", "structured outputs need a model with a tokenizer")
            self._grammars = GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammars

    # ---------------------------------------------------------------- requests
    def encode(self, prompt: str) -> list:
        if self.tokenizer is None:
            raise InvalidParameterError("prompt", "this model has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: Union[str, Sequence[int]],
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    arrival_time: Optional[float] = None) -> None:
        """Validate and queue a request. Raises InvalidParameterError (nothing queued) on bad input."""
        params = params or SamplingParams()
        if request_id in self.outputs:
            raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
        text, ids = self.validate_request(prompt, params)
        self.enqueue(request_id, text, ids, params, priority, arrival_time)

    def validate_request(self, prompt: Union[str, Sequence[int]], params: SamplingParams) -> tuple:
        """(prompt text or None, token ids) of a request this engine accepts (the prompt tokenised and checked,
        the context and the constraint too); raises InvalidParameterError otherwise."""
        text, ids = self._prompt_token_ids(prompt)
        self._check_fits(ids, params)
        if params.structured is not None:
            self.grammar_compiler.compile(params.structured)  # raises on a bad constraint before anything is queued
        return text, ids

    def enqueue(self, request_id: str, text: Optional[str], ids: list, params: SamplingParams, priority: int = 0,
                arrival_time: Optional[float] = None) -> None:
        """Queue a request that validate_request accepted (its text and ids), without checking it again
        (engine/disaggregated.py validates on arrival and queues after the prefill process is done)."""
        now = time.perf_counter() if arrival_time is None else arrival_time
        grammar = self.grammar_compiler if params.structured is not None else None
        samples = []
        for i in range(params.n):  # n samples: n scheduler requests, seeds seed, seed + 1, ...
            sp = params if params.n == 1 or params.seed is None else params.replace(seed=params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, sp, arrival_time=now, priority=priority, eos_token_ids=self.eos_token_ids)
            samples.append((req, SamplingState(params=sp, prompt_token_ids=req.prompt_token_ids,
                                               output_token_ids=req.output_token_ids,
                                               generator=make_generator(sp.seed, self.device),
                                               grammar=grammar.matcher(sp.structured) if grammar else None)))
        self.outputs.add(request_id, text, ids, params, samples, now)
        for req, _ in samples:
            self.scheduler.add_request(req)

    def _prompt_token_ids(self, prompt: Union[str, Sequence[int]]) -> tuple:
        """(prompt text or None, token ids), the ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("prompt", "the prompt is empty")
            return prompt, self.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidParameterError("prompt", "prompt token ids must be integers")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError("prompt", f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return None, ids

    def _check_fits(self, ids: list, params: SamplingParams) -> None:
        if not ids:
            raise InvalidParameterError("prompt", "the prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise InvalidParameterError(
                "prompt", f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens "
                          f"and at least one must be left for the output")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidParameterError(
                "max_tokens", f"this model's context is {self.max_model_len} tokens, but {len(ids)} prompt tokens + "
                              f"max_tokens {params.max_tokens} = {len(ids) + params.max_tokens} exceed it")

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is (waiting, mid-prefill, decoding); its blocks are freed now."""
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.outputs.num_unfinished) or self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return self.outputs.num_unfinished

    # ---------------------------------------------------------------- the step
    def step(self) -> list:
        """Run one scheduler step; return a RequestOutput for every request that changed."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.outputs.begin_step(out, t0)
        rows = [i for i, s in enumerate(out.scheduled) if s.will_sample]  # whose next token is due
        num_positions = sum(out.scheduled[i].num_sample_positions for i in rows)  # 1 + k for a verification
        spans = plan_prompt_spans(out.scheduled, self.outputs)  # prompt logprobs due this step
        logits = self._execute(out, rows, spans)
        if spans:  # the rows' sample positions come first, then the spans'
            record_prompt_logprobs(spans, out.scheduled, logits[num_positions:], self.outputs,
                                   self.model_config.vocab_size)
            logits = logits[:num_positions]
        decision = self.decider.decide(out, rows, logits, self.outputs)
        self.scheduler.update_from_output(out, {r: [t.token_id for t in toks] for r, toks in decision.tokens.items()})
        t1 = time.perf_counter()
        self.outputs.add_tokens(decision.tokens, t1)  # may finish requests, which frees their blocks
        if self.recompute_kv:
            self._discard_kv(out)
        self.decider.after_step(self.scheduler, self.outputs)  # speculation: drafts for the next step
        self._record_step(out, num_positions, decision, t0, time.perf_counter())
        return self.outputs.end_step()

    def _execute(self, out: SchedulerOutput, rows: list, spans: list) -> Optional[torch.Tensor]:
        """Logits [len(rows), V] of the scheduled sequences at `rows`, then those of the prompt
        spans' positions (None for an empty step)."""
        if not out.scheduled:
            return None
        # always run the model: a middle prefill chunk samples nothing but must write its KV
        logits = self.runner.execute(out.scheduled, rows, [(sp.row, sp.lo, sp.hi) for sp in spans])
        if not rows and self.device.type == "cuda":
            torch.cuda.synchronize()  # so that the step's wall time covers its GPU work
        return logits

    def _discard_kv(self, out: SchedulerOutput) -> None:
        for seq in out.scheduled:
            if not seq.request.status.is_finished:
                self.scheduler.discard_kv(seq.request.request_id)

    # ---------------------------------------------------------------- telemetry
    def _record_step(self, out: SchedulerOutput, num_logits: int, decision, t0: float, t1: float) -> None:
        self._step_counter += 1
        km = self.kv_manager
        ctx = [s.num_computed_tokens + s.num_new_tokens for s in out.scheduled]
        # a verification runs as 1 + k one-token rows (engine/model_runner.py), so it is predicted as such
        seqs = [(1, s.num_computed_tokens + j) if s.spec_token_ids else (s.num_new_tokens, s.num_computed_tokens)
                for s in out.scheduled for j in range(1 + len(s.spec_token_ids))]
        npf_seqs = sum(1 for s in out.scheduled if s.is_prefill)
        rec = StepRecord(
            step=self._step_counter, start_time=t0, wall_seconds=t1 - t0,
            num_prefill_seqs=npf_seqs, num_decode_seqs=len(out.scheduled) - npf_seqs,
            num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
            context_lens=ctx, kv_blocks_used=km.num_used_blocks, kv_blocks_free=km.num_free_blocks,
            kv_blocks_cached=km.num_cached_blocks, kv_usage=km.usage,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_preemptions_total=self.scheduler.num_preemptions, grammar_mask_seconds=decision.mask_seconds,
            kv_bytes_used=kv_bytes_used(km, self.kv_bytes_per_token))
        rec.num_spec_seqs, rec.num_draft_tokens, rec.num_accepted_tokens = (
            decision.num_spec_seqs, decision.num_draft_tokens, decision.num_accepted_tokens)
        if out.scheduled:
            ex = self.executor.step_stats()
            rec.comm_seconds, rec.comm_bytes = ex.comm_seconds, ex.comm_bytes
            rec.pipeline_micro_batches = ex.micro_batches
            if ex.expert_rows_per_rank:  # expert parallelism: the load of each rank and the all-to-alls
                record_expert_parallel(rec, ex.expert_rows_per_rank, ex.all_to_all_seconds, ex.all_to_all_bytes)
            if self.model_config.moe is not None:  # the step's routing (model/moe.py, telemetry/moe.py)
                record_routing(rec, *self.executor.take_routing())
        if self._cost is not None and seqs:
            self._cost.annotate(rec, seqs, num_logits=num_logits)
        self.step_records.append(rec)
        for fn in self.step_listeners:
            fn(rec)

    def kv_cache_state(self) -> dict:
        km, cc = self.kv_manager, self.cache_config
        return {
            "num_blocks": km.num_blocks, "block_size": cc.block_size,
            "blocks_used": km.num_used_blocks, "blocks_free": km.num_free_blocks,
            "blocks_cached": km.num_cached_blocks, "usage": km.usage,
            "bytes_per_token": self.kv_bytes_per_token, "capacity_tokens": km.num_blocks * cc.block_size,
            "dtype": str(self.kv_dtype).replace("torch.", ""),
            "total_bytes": self.runner.kv_cache_bytes,
            "prefix_cache_queries": km.prefix_cache_queries, "prefix_cache_hits": km.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
            **self.decider.state(),
            **({"groups": km.group_stats()} if km.num_groups > 1 else {}),  # a block table per group of layers
        }
