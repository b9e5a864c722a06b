"""LLMEngine: add requests, step, get incremental outputs. The only glue between the layers.

One step:
  Scheduler.schedule() -> SchedulerOutput (which requests, how many tokens each)
  ModelRunner.execute() -> logits of each request whose next token is due
  Sampler -> one token per such request
  Scheduler.update_from_output() -> KV positions advance, tokens appended
  here: detokenize incrementally, check stop conditions, free finished requests' blocks,
        record a StepRecord (with the cost model's prediction) and the request metrics.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from servescope.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from servescope.engine.kv_sizing import kv_bytes_per_token, num_kv_blocks
from servescope.engine.executor import ModelExecutor
from servescope.engine.model_runner import ModelRunner
from servescope.engine.outputs import CompletionOutput, RequestOutput
from servescope.errors import EngineConfigError, InvalidParameterError
from servescope.kvcache.manager import KVCacheManager
from servescope.model.attention import get_attention_backend
from servescope.loader.build import DTYPES
from servescope.sampling.sampler import Sampler, SamplingState, make_generator
from servescope.sampling.stop import find_stop_string, max_stop_holdback
from servescope.scheduler.request import Request, RequestStatus
from servescope.scheduler.scheduler import Scheduler
from servescope.telemetry.request_metrics import RequestMetrics
from servescope.telemetry.step_record import StepRecord

logger = logging.getLogger(__name__)

STEP_HISTORY = 100_000  # step records kept in memory (a few hundred bytes each)

_FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
                  "abort": RequestStatus.FINISHED_ABORTED, "error": RequestStatus.FINISHED_ERROR}


@dataclass
class _Sample:
    """Engine-side state of one sample (one scheduler Request) of a user request."""

    index: int
    request: Request
    state: SamplingState
    detok: object  # IncrementalDetokenizer or None (no tokenizer)
    metrics: RequestMetrics
    text: str = ""
    finish_reason: Optional[str] = None
    stop_reason: object = None
    logprobs: Optional[list] = None
    cumulative_logprob: float = 0.0


@dataclass
class _Group:
    """A user request: n samples sharing one prompt (their full prompt blocks are shared through the
    prefix cache, by reference count)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    params: SamplingParams
    samples: list = field(default_factory=list)
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None, _shared: Optional["LLMEngine"] = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineConfigError("device 'cuda' was asked for but torch sees no CUDA device")
        dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        if dtype_name == "float16" and self.device.type == "cpu":
            raise EngineConfigError("float16 is for GPUs; on the CPU use float32 or bfloat16")
        self.dtype = DTYPES[dtype_name]
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else DTYPES[config.kv_cache_dtype]
        t0 = time.perf_counter()
        if _shared is not None:
            # same weights, new KV cache and scheduler (tests and labs compare engine settings)
            self.executor = _shared.executor.fork()
            self.model_config, self.tokenizer, self.source_path = _shared.model_config, _shared.tokenizer, _shared.source_path
        else:
            model, self.model_config, self.tokenizer, self.source_path = self._load(config)
            self.executor = ModelExecutor.prepare(model, self.device, config.quantization, config.gpu_linear)
        self.model = self.executor.model
        cfg = self.model_config
        self.load_seconds = time.perf_counter() - t0
        self.weight_bytes = self.executor.weight_bytes

        blocks = num_kv_blocks(config, cfg, self.kv_dtype, self.device)
        capacity = blocks * config.block_size
        max_len = config.max_model_len or cfg.max_position_embeddings
        if capacity < max_len:
            if config.max_model_len is not None:
                raise EngineConfigError(
                    f"the KV cache holds {capacity} tokens ({blocks} blocks of {config.block_size}), fewer than "
                    f"max_model_len={max_len}: one request could never fit; give more KV memory or a smaller "
                    f"max_model_len")
            max_len = capacity
        self.max_model_len = max_len
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, self.kv_dtype)
        backend = get_attention_backend(config.attention_backend, self.device)
        self.runner = ModelRunner(self.executor, cfg, backend, blocks, config.block_size, self.kv_dtype, self.device)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %d bytes per token, %.1f MiB (%s)",
                    blocks, config.block_size, capacity, self.kv_bytes_per_token,
                    self.runner.kv_cache_bytes / 2**20, str(self.kv_dtype).replace("torch.", ""))
        self.cache_config = CacheConfig(block_size=config.block_size, num_blocks=blocks,
                                        enable_prefix_caching=config.enable_prefix_caching and not config.no_kv_cache)
        max_batched = config.max_num_batched_tokens
        if config.no_kv_cache or not config.enable_chunked_prefill:
            max_batched = max(max_batched, max_len)  # a whole sequence must fit in one step
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=max_len,
            enable_chunked_prefill=config.enable_chunked_prefill and not config.no_kv_cache,
            block_size=config.block_size)
        self.kv_manager = KVCacheManager(self.cache_config)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager)
        self.eos_token_ids = self._eos_ids()
        self.sampler = Sampler(cfg.vocab_size, eos_token_ids=self.eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple] = {}  # scheduler request id -> (group, sample)
        self.step_records: collections.deque = collections.deque(maxlen=STEP_HISTORY)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self._step_counter = 0
        self.start_time = time.perf_counter()
        self._cost = None
        if config.predict_step_cost:
            from servescope.engine.step_cost import StepCostPredictor

            self._cost = StepCostPredictor(cfg, self.device, self.dtype, self.kv_dtype, config.quantization,
                                           config.hardware)
        self._maybe_cuda_graphs()

    def with_config(self, **overrides) -> "LLMEngine":
        """A new engine on the same weights with other settings (KV size, chunking, caching...).
        Weight-changing settings (model, dtype, device, quantization) must stay the same."""
        for k in ("model", "dtype", "device", "quantization"):
            if k in overrides and overrides[k] != getattr(self.config, k):
                raise EngineConfigError(f"with_config cannot change {k}; build a new engine")
        return LLMEngine(self.config.replace(**overrides), _shared=self)

    # ---------------------------------------------------------------- loading
    def _load(self, config: EngineConfig):
        model_name = config.model
        max_pos = config.max_model_len
        if model_name and model_name.startswith("random:"):
            from servescope.analysis.presets import load_preset
            from servescope.loader.random_init import build_random_model

            cfg = load_preset(model_name[len("random:"):])
            model = build_random_model(cfg, self.dtype, self.device, max_positions=max_pos, seed=config.seed)
            return model, cfg, None, model_name
        from servescope.loader.build import build_model
        from servescope.loader.source import load_model_source
        from servescope.tokenizer import load_tokenizer

        src = load_model_source(model_name)
        model = build_model(src.config, src.state_dict, self.dtype, self.device,
                            max_positions=max(max_pos or 0, src.config.max_position_embeddings))
        tok = load_tokenizer(src.tokenizer_source)
        return model, src.config, tok, src.path

    def _eos_ids(self) -> tuple:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))

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

    def _maybe_cuda_graphs(self):
        if not (self.device.type == "cuda" and self.config.use_cuda_graph and self.runner.backend.name == "triton"):
            return
        sizes = [b for b in self.config.cuda_graph_batch_sizes if b <= self.config.max_num_seqs]
        self.executor.capture_cuda_graphs(self.runner, sizes, -(-self.max_model_len // self.config.block_size))

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
        if request_id in self._groups:
            raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("prompt", "the prompt is empty")
            text, ids = prompt, self.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidParameterError("prompt", "prompt token ids must be integers")
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidParameterError(
                    "prompt", f"token id {bad[0]} is outside the vocabulary (0..{self.model_config.vocab_size - 1})")
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
        now = time.perf_counter() if arrival_time is None else arrival_time
        group = _Group(request_id, text, ids, params)
        for i in range(params.n):
            sp = params if params.n == 1 or params.seed is None else params.replace(seed=params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, sp, arrival_time=now, priority=priority, eos_token_ids=self.eos_token_ids)
            state = SamplingState(params=sp, prompt_token_ids=req.prompt_token_ids,
                                  output_token_ids=req.output_token_ids,
                                  generator=make_generator(sp.seed, self.device))
            detok = None
            if self.tokenizer is not None:
                from servescope.tokenizer import IncrementalDetokenizer

                detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=sp.skip_special_tokens)
            sample = _Sample(i, req, state, detok, RequestMetrics(arrival_time=now, num_prompt_tokens=len(ids)),
                             logprobs=[] if sp.logprobs is not None else None)
            group.samples.append(sample)
        self._groups[request_id] = group
        for s in group.samples:
            self._samples[s.request.request_id] = (group, s)
            self.scheduler.add_request(s.request)

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is (waiting, mid-prefill, decoding); its blocks are freed now."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.samples:
            self._samples.pop(s.request.request_id, None)
            if s.finish_reason is None:
                s.finish_reason = "abort"
                self.scheduler.finish_request(s.request.request_id, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._groups) or self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    # ---------------------------------------------------------------- the step
    def step(self) -> list:
        """Run one scheduler step; return a RequestOutput for every request that changed."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        changed: dict[str, _Group] = {}
        for req in out.finished_requests:  # the scheduler refused these (they can never fit)
            gs = self._samples.get(req.request_id)
            if gs:
                group, sample = gs
                sample.finish_reason = "error"
                group.error = req.error
                sample.metrics.finished_time = t0
                changed[group.request_id] = group
        sampled: dict[str, int] = {}
        sample_rows = [i for i, s in enumerate(out.scheduled) if s.will_sample]
        if out.scheduled:
            for seq in out.scheduled:
                m = self._samples[seq.request.request_id][1].metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = t0
            # always run the model: a middle prefill chunk samples nothing but must write its KV
            logits = self.runner.execute(out.scheduled, sample_rows)
            if sample_rows:
                states = [self._samples[out.scheduled[i].request.request_id][1].state for i in sample_rows]
                so = self.sampler(logits, states)
                for j, i in enumerate(sample_rows):
                    rid = out.scheduled[i].request.request_id
                    sampled[rid] = so.token_ids[j]
                    sample = self._samples[rid][1]
                    if sample.logprobs is not None and so.logprobs[j] is not None:
                        sample.logprobs.append(so.logprobs[j])
                        sample.cumulative_logprob += so.logprobs[j].logprob
            elif self.device.type == "cuda":
                torch.cuda.synchronize()  # so that the step's wall time covers its GPU work
        self.scheduler.update_from_output(out, sampled)
        t1 = time.perf_counter()
        for rid, tok in sampled.items():
            group, sample = self._samples[rid]
            sample.metrics.token_times.append(t1)
            self._process_token(group, sample, tok)
            changed[group.request_id] = group
        if self.config.no_kv_cache:
            for seq in out.scheduled:
                if not seq.request.status.is_finished:
                    self.scheduler.discard_kv(seq.request.request_id)
        self._record_step(out, t0, t1)
        outputs = []
        for group in changed.values():
            outputs.append(self._make_output(group))
            if group.finished:
                self._groups.pop(group.request_id, None)
                for s in group.samples:
                    self._samples.pop(s.request.request_id, None)
        return outputs

    def _process_token(self, group: _Group, sample: _Sample, tok: int) -> None:
        req, sp = sample.request, sample.state.params
        n_out = req.num_output_tokens
        is_eos = tok in self.eos_token_ids and not sp.ignore_eos
        finish, stop_reason = None, None
        # the sampler masks EOS and stop_token_ids until min_tokens outputs exist
        if is_eos or tok in sp.stop_token_ids:
            finish, stop_reason = "stop", (tok if tok in sp.stop_token_ids else None)
        elif sample.detok is not None:
            delta = sample.detok.add(tok)
            if delta:
                sample.text += delta
                if sp.stop and n_out >= sp.min_tokens:
                    found = find_stop_string(sample.text, len(delta), sp.stop)
                    if found is not None:
                        idx, stop_reason = found
                        cut = idx + len(stop_reason) if sp.include_stop_str_in_output else idx
                        sample.text = sample.text[:cut]
                        finish = "stop"
        if finish is None and (n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len):
            finish = "length"
        if finish is not None:
            self._finish(sample, finish, stop_reason)

    def _finish(self, sample: _Sample, reason: str, stop_reason=None) -> None:
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        sample.metrics.finished_time = time.perf_counter()
        sample.metrics.num_cached_tokens = max(sample.request.num_cached_tokens, 0)
        sample.metrics.num_preemptions = sample.request.num_preemptions
        self.scheduler.finish_request(sample.request.request_id, _FINISH_STATUS[reason])

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for s in group.samples:
            text = s.text
            if s.finish_reason is None and s.state.params.stop:
                hold = max_stop_holdback(s.state.params.stop)
                text = text[:max(0, len(text) - hold)]
            outs.append(CompletionOutput(
                index=s.index, text=text, token_ids=list(s.request.output_token_ids),
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                metrics=s.metrics))
        cached = max((s.request.num_cached_tokens for s in group.samples), default=0)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                             finished=group.finished, error=group.error, num_cached_tokens=max(cached, 0))

    # ---------------------------------------------------------------- telemetry
    def _record_step(self, out, t0: float, t1: float) -> None:
        self._step_counter += 1
        km = self.kv_manager
        ctx, seqs = [], []
        npf_seqs = nd_seqs = 0
        for s in out.scheduled:
            ctx.append(s.num_computed_tokens + s.num_new_tokens)
            seqs.append((s.num_new_tokens, s.num_computed_tokens))
            if s.is_prefill:
                npf_seqs += 1
            else:
                nd_seqs += 1
        rec = StepRecord(
            step=self._step_counter, start_time=t0, wall_seconds=t1 - t0,
            num_prefill_seqs=npf_seqs, num_decode_seqs=nd_seqs,
            num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
            context_lens=ctx, kv_blocks_used=km.num_used_blocks, kv_blocks_free=km.num_free_blocks,
            kv_blocks_cached=km.num_cached_blocks, kv_usage=km.usage,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_preemptions_total=self.scheduler.num_preemptions)
        if self._cost is not None and seqs:
            self._cost.annotate(rec, seqs, num_logits=sum(1 for s in out.scheduled if s.will_sample))
        self.step_records.append(rec)
        for fn in self.step_listeners:
            fn(rec)

    def kv_cache_state(self) -> dict:
        km = self.kv_manager
        return {
            "num_blocks": self.cache_config.num_blocks, "block_size": self.cache_config.block_size,
            "blocks_used": km.num_used_blocks, "blocks_free": km.num_free_blocks,
            "blocks_cached": km.num_cached_blocks, "usage": km.usage,
            "bytes_per_token": self.kv_bytes_per_token, "capacity_tokens": self.cache_config.num_blocks * self.cache_config.block_size,
            "total_bytes": self.runner.kv_cache_bytes,
            "prefix_cache_queries": km.prefix_cache_queries, "prefix_cache_hits": km.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
        }


