"""Request fields that constrain the output -> one StructuredOutput, compiled before queuing.

OpenAI's `response_format` (json_object, json_schema with `strict`), vLLM's `structured_outputs`
(json, regex, choice, grammar, json_object). At most one of them per request; a constraint that
does not compile (an invalid schema, a regex that cannot be parsed or can match nothing) or breaks a
cap of ServerLimits is a 400 naming the field, with nothing queued. Checking and compiling happen in
server/grammar_service.py, off the event loop.
"""

from __future__ import annotations

import json
from typing import Optional

from servescope.config import StructuredOutput
from servescope.errors import InvalidParameterError
from servescope.server.serving_common import ServingContext


def requested_structure(req) -> tuple:
    """(StructuredOutput or None, the request field it came from)."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise InvalidParameterError("structured_outputs", "give response_format or structured_outputs, not both")
    if rf is not None and rf.type != "text":
        return _from_response_format(rf), "response_format"
    if so is not None:
        return _from_structured_outputs(so), "structured_outputs"
    return None, None


def _from_response_format(rf) -> StructuredOutput:
    if rf.type == "json_object":
        return StructuredOutput("json_object")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise InvalidParameterError("response_format", "response_format json_schema needs json_schema.schema")
    return StructuredOutput("json", _schema_text(rf.json_schema.schema_, "response_format"))


def _from_structured_outputs(so) -> StructuredOutput:
    given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        raise InvalidParameterError("structured_outputs", "structured_outputs needs exactly one of json, regex, "
                                                          f"choice, grammar, json_object (got {len(given)})")
    kind = given[0]
    if kind == "json_":
        value = so.json_
        text = value if isinstance(value, str) else _schema_text(value, "structured_outputs")
        return StructuredOutput("json", text)
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        if not so.choice or any(not c for c in so.choice):
            raise InvalidParameterError("structured_outputs", "structured_outputs.choice needs non-empty strings")
        return StructuredOutput("choice", tuple(so.choice))
    value = getattr(so, kind)
    if not value:
        raise InvalidParameterError("structured_outputs", f"structured_outputs.{kind} is empty")
    return StructuredOutput(kind, value)


def _schema_text(schema: dict, param: str) -> str:
    """The schema as JSON text (checked with the caps and compiled on the grammar pool)."""
    try:
        return json.dumps(schema)
    except (ValueError, RecursionError):
        raise InvalidParameterError(param, "the JSON schema is nested too deeply") from None


async def compile_structure(ctx: ServingContext, spec: Optional[StructuredOutput],
                            param: Optional[str]) -> Optional[StructuredOutput]:
    """spec with its compiled grammar (None stays None); a failure names the request field."""
    return await ctx.grammars.compile(spec, param)
