"""The Responses API's shapes: the response envelope, its output items (ResponseBuilder) and the
streamed event sequence (stream_events), from the chat engine's parsed samples and deltas."""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Callable, Optional

from servescope.server.chat_engine import ChatRun, ParsedSample, SampleStreamer, count_reasoning
from servescope.server.errors import to_api_error
from servescope.server.serving_chat import _logprob_content
from servescope.server.serving_common import check_finish, merge_streams


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The response object of one request, in progress or final."""

    def __init__(self, ctx, req, run: ChatRun, rid: str, created: int):
        self.ctx, self.req, self.run, self.rid, self.created = ctx, req, run, rid, created

    def envelope(
        self, status: str, output: list, usage: Optional[dict] = None, incomplete: Optional[str] = None
    ) -> dict:
        req = self.req
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text and req.text.format
            else None
        )
        choice = req.tool_choice
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.ctx.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
            "tools": [dict(t, strict=t.get("strict", False)) for t in (req.tools or [])],
            "truncation": "disabled",
            "usage": usage,
            "metadata": req.metadata or {},
        }

    def usage(self, o, reasoning_tokens: int, cached: int = 0) -> dict:
        n_in, n_out = len(self.run.prompt_ids), len(o.token_ids)
        return {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": n_in + n_out,
        }

    def logprobs(self, o) -> list:
        if self.run.top_n is None:
            return []
        return _logprob_content(self.run.ctx, o.logprobs or [], self.run.top_n)

    @staticmethod
    def reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
        return {
            "id": rid,
            "type": "reasoning",
            "summary": [],
            "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [],
        }

    @staticmethod
    def message_item(mid: str, text: str, logprobs: list, status: str = "completed") -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content if status == "completed" else [],
        }

    @staticmethod
    def call_item(fid: str, call: dict, arguments: str, status: str = "completed") -> dict:
        return {
            "id": fid,
            "type": "function_call",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": arguments,
            "status": status,
        }

    def final(self, p: ParsedSample, o, cached: int = 0) -> dict:
        output = []
        if p.reasoning is not None:
            output.append(self.reasoning_item(_id("rs"), p.reasoning))
        if p.content or (not output and not p.calls):
            output.append(self.message_item(_id("msg"), p.content or "", self.logprobs(o)))
        for c in p.calls:
            output.append(self.call_item(_id("fc"), c, c["function"]["arguments"]))
        incomplete = "max_output_tokens" if o.finish_reason == "length" else None
        return self.envelope(
            "incomplete" if incomplete else "completed",
            output,
            self.usage(o, p.reasoning_tokens, cached),
            incomplete,
        )


class _EventWriter:
    """Open output items and the events that open, grow and close them."""

    def __init__(self, b: ResponseBuilder):
        self.b = b
        self.seq = itertools.count()
        self.output: list = []  # finished items
        self.kind: Optional[str] = None  # the open item: reasoning | message | call
        self.item_id, self.text = "", ""
        self.call: Optional[dict] = None

    def ev(self, kind: str, **fields) -> str:
        data = {"type": kind, **fields, "sequence_number": next(self.seq)}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.item_id, "output_index": len(self.output)}

    def open(self, kind: str, call: Optional[dict] = None) -> list:
        evs = self.close()
        self.kind, self.text, self.call = kind, "", call
        b, where = self.b, None
        if kind == "reasoning":
            self.item_id = _id("rs")
            item, part = (
                b.reasoning_item(self.item_id, "", "in_progress"),
                {"type": "reasoning_text", "text": ""},
            )
        elif kind == "message":
            self.item_id = _id("msg")
            item = b.message_item(self.item_id, "", [], "in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            self.item_id = _id("fc")
            item, part = b.call_item(self.item_id, call, "", "in_progress"), None
        where = self._where()
        evs.append(self.ev("response.output_item.added", output_index=where["output_index"], item=item))
        if part is not None:
            evs.append(self.ev("response.content_part.added", **where, content_index=0, part=part))
        return evs

    def grow(self, kind: str, delta: str, call: Optional[dict] = None) -> list:
        evs = (
            []
            if self.kind == kind and (call is None or call["id"] == self.call["id"])
            else self.open(kind, call)
        )
        if not delta:
            return evs
        self.text += delta
        where = self._where()
        if kind == "reasoning":
            evs.append(self.ev("response.reasoning_text.delta", **where, content_index=0, delta=delta))
        elif kind == "message":
            evs.append(
                self.ev("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])
            )
        else:
            evs.append(self.ev("response.function_call_arguments.delta", **where, delta=delta))
        return evs

    def close(self, o=None) -> list:
        if self.kind is None:
            return []
        b, where, text, evs = self.b, self._where(), self.text, []
        if self.kind == "reasoning":
            item, part = b.reasoning_item(self.item_id, text), {"type": "reasoning_text", "text": text}
            evs.append(self.ev("response.reasoning_text.done", **where, content_index=0, text=text))
        elif self.kind == "message":
            lp = b.logprobs(o) if o is not None else []
            item = b.message_item(self.item_id, text, lp)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lp}
            evs.append(self.ev("response.output_text.done", **where, content_index=0, text=text, logprobs=lp))
        else:
            item, part = b.call_item(self.item_id, self.call, text), None
            evs.append(
                self.ev(
                    "response.function_call_arguments.done",
                    **where,
                    arguments=text,
                    name=self.call["function"]["name"],
                )
            )
        if part is not None:
            evs.append(self.ev("response.content_part.done", **where, content_index=0, part=part))
        evs.append(self.ev("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self.kind = None
        return evs

    def calls(self, deltas: list) -> list:
        evs = []
        for d in deltas:
            if "id" in d:  # a new call: its name comes with it, its arguments now or later
                call = {"id": d["id"], "function": {"name": d["function"]["name"]}}
                evs += self.open("call", call)
            evs += self.grow("call", d.get("function", {}).get("arguments", ""), self.call)
        return evs


async def stream_events(b: ResponseBuilder, finish: Callable[[dict], None]):
    """The SSE events of a streamed response; `finish` gets the final response body."""
    w, run = _EventWriter(b), b.run
    yield w.ev("response.created", response=b.envelope("in_progress", []))
    yield w.ev("response.in_progress", response=b.envelope("in_progress", []))
    streamer = SampleStreamer(run)
    try:
        async for _, out in merge_streams(run.streams):
            o = out.outputs[0]
            reason = check_finish(o, out.error)
            dr, dc, calls = streamer.feed(o.text, reason is not None)
            for e in (
                (w.grow("reasoning", dr) if dr else [])
                + (w.grow("message", dc) if dc else [])
                + w.calls(calls)
            ):
                yield e
            if reason is None:
                continue
            evs = w.close(o)
            if not w.output:  # an empty answer is still a message, as in the non-streamed response
                evs += w.open("message") + w.close(o)
            for e in evs:
                yield e
            n_reasoning = run.reasoning.count_tokens(o.text, o.token_ids) if run.reasoning is not None else 0
            count_reasoning(run, n_reasoning)
            incomplete = "max_output_tokens" if o.finish_reason == "length" else None
            body = b.envelope(
                "incomplete" if incomplete else "completed",
                w.output,
                b.usage(o, n_reasoning, out.num_cached_tokens),
                incomplete,
            )
            finish(body)
            yield w.ev("response.incomplete" if incomplete else "response.completed", response=body)
            return
    except Exception as e:  # noqa: BLE001 - after the 200 went out, errors travel in the stream
        a = to_api_error(e)
        yield w.ev("error", code=a.code, message=a.message, param=a.param)
