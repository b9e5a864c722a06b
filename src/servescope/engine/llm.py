"""LLM: the synchronous Python API. `LLM(...).generate(prompts, params)` runs every prompt through
the engine's continuous-batching loop at once and returns one RequestOutput per prompt, in order."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from tqdm import tqdm

from servescope.config import EngineConfig, SamplingParams, SpeculativeConfig
from servescope.engine.llm_engine import LLMEngine
from servescope.engine.outputs import RequestOutput
from servescope.errors import InvalidParameterError

Prompt = Union[str, Sequence[int]]


class LLM:
    def __init__(self, model: Optional[str] = None, dtype: str = "float32", device: str = "cpu",
                 block_size: int = 16, speculative: Optional[dict] = None, hardware_spec=None, **engine_kwargs):
        """speculative: vLLM-style speculative settings, e.g. {"method": "ngram", "num_speculative_tokens": 4}
        (SpeculativeConfig.from_dict). hardware_spec: the resolved spec to predict steps on (LLMEngine)."""
        if speculative is not None:
            engine_kwargs["speculative"] = SpeculativeConfig.from_dict(speculative)
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, device=device, block_size=block_size,
                                             **engine_kwargs), hardware_spec=hardware_spec)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def with_config(self, **overrides) -> "LLM":
        """Same weights, other engine settings (see LLMEngine.with_config)."""
        return LLM.from_engine(self.engine.with_config(**overrides))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = False, priority: Optional[Sequence[int]] = None) -> list:
        """prompts: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidParameterError("sampling_params",
                                            f"{len(params)} sampling params for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm, priority)

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True) -> list:
        """messages: one conversation (list of {role, content}) or a list of conversations."""
        if self.tokenizer is None:
            raise InvalidParameterError("messages", "this model has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs]
        # the template already holds the special tokens (BOS); encode without adding them again
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(ids, sampling_params, use_tqdm=use_tqdm)
        for o, p in zip(outs, prompts):
            o.prompt = p
        return outs

    def _run(self, prompts, params, use_tqdm, priority) -> list:
        engine = self.engine
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = f"gen-{next(self._ids)}"
                engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:  # bad input changes nothing: take back what was queued
                engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            bar = tqdm(total=len(ids), desc="requests", unit="req", dynamic_ncols=True)
        try:
            while len(final) < len(ids):
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not engine.has_unfinished() and len(final) < len(ids):
                    raise RuntimeError("engine stopped with requests unfinished")
        except BaseException:
            for rid in ids:
                if rid not in final:
                    engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[r] for r in ids]
