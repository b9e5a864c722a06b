"""GrammarService: structured-output constraints checked and compiled in a bounded pool, with a deadline.

A compile costs milliseconds to seconds and cannot be interrupted (xgrammar's C++), so it never runs
on the event loop, the engine thread or the shared default thread pool: it runs on a pool of its own
(`grammar_compile_threads`), at most `grammar_compile_queue` compiles wait or run at once (429
beyond), and a request waits at most `grammar_compile_timeout_s` (400 after; the compile finishes in
the background and lands in the cache, so a retry is quick). The caps that bound one compile's cost
(schema depth and properties, grammar bytes, choices) and the JSON schema's own validity are checked
on the same pool, first: none of it touches the event loop. Compiled grammars are kept in xgrammar's
cache up to `grammar_cache_bytes` (least recently used evicted); a request carries its own compiled
grammar to the engine, so the engine thread never compiles, whatever the cache evicted meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import jsonschema

from servescope.config import StructuredOutput
from servescope.engine.async_engine import AsyncEngine, QueueFullError
from servescope.errors import InvalidParameterError

logger = logging.getLogger(__name__)


class GrammarService:
    def __init__(self, async_engine: AsyncEngine, limits):
        self.engine = async_engine
        self.limits = limits
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending = 0  # compiles waiting or running (event loop only)
        self._configured = False
        self._lock = threading.Lock()
        self.timeouts = 0

    def check_size(self, spec: StructuredOutput, param: str) -> None:
        """The caps that need no parsing (event loop, cheap): bytes and choices."""
        lim = self.limits
        if spec.kind == "choice":
            if len(spec.spec) > lim.max_choices:
                raise InvalidParameterError(param, f"at most {lim.max_choices} choices, got {len(spec.spec)}")
            size = sum(len(c.encode("utf-8", "surrogatepass")) for c in spec.spec)
        else:
            size = len(spec.spec.encode("utf-8", "surrogatepass")) if isinstance(spec.spec, str) else 0
        if size > lim.max_grammar_bytes:
            raise InvalidParameterError(
                param,
                f"the {spec.kind} constraint ({size} bytes) is over the limit of "
                f"{lim.max_grammar_bytes} bytes",
            )

    async def compile(
        self, spec: Optional[StructuredOutput], param: Optional[str]
    ) -> Optional[StructuredOutput]:
        """spec with its compiled grammar attached (None stays None). InvalidParameterError naming param
        when it breaks a cap, is invalid, matches nothing or misses the deadline; QueueFullError when
        the compile queue is full."""
        if spec is None:
            return None
        self.check_size(spec, param)
        if self._pending >= self.limits.grammar_compile_queue:
            raise QueueFullError(
                f"the grammar compiler is busy ({self._pending} compiles queued, limit "
                f"{self.limits.grammar_compile_queue})"
            )
        self._pending += 1
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor(), self._work, spec)
        fut.add_done_callback(self._done)
        try:
            compiled = await asyncio.wait_for(asyncio.shield(fut), self.limits.grammar_compile_timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            raise InvalidParameterError(
                param,
                f"the {spec.kind} constraint did not compile within "
                f"{self.limits.grammar_compile_timeout_s:g} s",
            ) from None
        except InvalidParameterError as e:
            raise InvalidParameterError(param, e.message) from None
        return dataclasses.replace(spec, compiled=compiled)

    def _done(self, fut) -> None:
        self._pending -= 1
        if (
            not fut.cancelled()
            and fut.exception() is not None
            and not isinstance(fut.exception(), InvalidParameterError)
        ):
            logger.error("grammar compile failed", exc_info=fut.exception())

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.limits.grammar_compile_threads, thread_name_prefix="servescope-grammar"
            )
        return self._pool

    def warm(self) -> None:
        """Build the engine's grammar compiler (its vocabulary tables: seconds for a large vocabulary)
        on the pool now, so that the first structured request does not pay for it against its deadline."""
        if getattr(self.engine, "tokenizer", None) is not None:
            self._executor().submit(self.compiler)

    def compiler(self):
        """The engine's GrammarCompiler with this server's cache limit (pool threads only)."""
        compiler = self.engine.engine.grammar_compiler
        with self._lock:
            if not self._configured:
                compiler.set_cache_limit(self.limits.grammar_cache_bytes)
                self._configured = True
        return compiler

    def _work(self, spec: StructuredOutput):  # pool thread
        if spec.kind == "json":
            try:
                schema = json.loads(spec.spec)
            except (ValueError, RecursionError):
                raise InvalidParameterError("structured", "the JSON schema is not valid JSON") from None
            check_schema_caps(schema, self.limits)
            check_schema(schema)
        return self.compiler().compile(spec)

    def cache_bytes(self) -> Optional[int]:
        grammars = self.engine.engine._grammars  # None until the first structured request
        return None if grammars is None else grammars.cache_bytes()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def check_schema_caps(schema, limits) -> None:
    """Depth and property count of a parsed schema, walked without recursion (a deep one is refused
    before anything recursive sees it)."""
    if not isinstance(schema, dict):
        raise InvalidParameterError("structured", "a JSON schema must be an object")
    stack, properties = [(schema, 1)], 0
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_schema_depth:
            raise InvalidParameterError(
                "structured", f"the JSON schema is nested deeper than {limits.max_schema_depth} levels"
            )
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                if properties > limits.max_schema_properties:
                    raise InvalidParameterError(
                        "structured",
                        f"the JSON schema has more than {limits.max_schema_properties} properties",
                    )
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        else:
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def check_schema(schema: dict) -> None:
    """A JSON schema must itself be valid (its declared draft, else Draft 2020-12), else 400."""
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.exceptions.SchemaError as e:
        raise InvalidParameterError("structured", f"the JSON schema is invalid: {e.message}") from None
    except RecursionError:
        raise InvalidParameterError("structured", "the JSON schema is nested too deeply to check") from None
