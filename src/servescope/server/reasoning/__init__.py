"""Reasoning parsers (`serve --reasoning-parser`): a model's <think>...</think> block split from its
answer, in whole outputs and in streams, and its token count (parser.py)."""

from servescope.server.reasoning.parser import (PARSERS, ReasoningParser, ReasoningStreamer, ReasoningStyle,
                                                make_reasoning_parser)

__all__ = ["PARSERS", "ReasoningParser", "ReasoningStreamer", "ReasoningStyle", "make_reasoning_parser"]
