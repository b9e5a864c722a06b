"""Splitting a model's reasoning from its answer: `[<think>] reasoning </think> answer`.

Three styles, vLLM's names:
  - deepseek_r1: the chat template opens the block in the prompt, so the output starts inside it
    (a leading <think> the model writes anyway is dropped); no </think>: all of it is reasoning.
  - qwen3: the output opens the block itself (<think> first, after whitespace); otherwise there is
    no reasoning (e.g. chat_template_kwargs.enable_thinking false: the template wrote an empty block
    into the prompt). An open block that never closes (max_tokens) is reasoning.
  - openai_gptoss: gpt-oss's harmony channels, `<|channel|>analysis<|message|>reasoning<|end|>` then
    `<|start|>assistant<|channel|>final<|message|>answer` (the final header alone when there is no
    analysis); the header that opens the answer is dropped. Its markers are special tokens, so its
    requests keep special tokens in their text (`special_markers`). A call to a function in the commentary
    channel stays in the answer, where the tool-call parser takes it (server/tool_calls.py).
The text after </think> is the answer as the model wrote it (vLLM strips nothing either).

The streamer's deltas always concatenate to the whole-output split of the text so far: it holds
back what may still turn into a marker, so a streamed answer reassembles to the non-streamed one.
The token count (usage.completion_tokens_details.reasoning_tokens) runs through the end marker's
tokens; the thinking budget (config.ThinkingBudget) forces those tokens when the block runs long.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from servescope.config import ThinkingBudget
from servescope.errors import InvalidParameterError


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    starts_in_reasoning: bool  # the prompt opened the block (deepseek_r1)
    start: str = "<think>"
    end: str = "</think>"
    answer_starts: tuple = ()  # headers that open the answer, dropped from it (harmony's final channel)
    special_markers: bool = False  # the markers are special tokens: the text must keep them


HARMONY_FINAL = ("<|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>")
PARSERS = {"deepseek_r1": ReasoningStyle("deepseek_r1", True), "qwen3": ReasoningStyle("qwen3", False),
           "openai_gptoss": ReasoningStyle("openai_gptoss", False, "<|channel|>analysis<|message|>", "<|end|>",
                                           HARMONY_FINAL, special_markers=True)}


def _split(style: ReasoningStyle, text: str, finished: bool) -> Optional[tuple]:
    """(reasoning or None, answer or None), or None while the text may still open a block."""
    parts = _split_block(style, text, finished)
    if parts is None or not style.answer_starts or parts[1] is None:
        return parts
    return parts[0], _answer(style, parts[1], finished)


def _answer(style: ReasoningStyle, text: str, finished: bool) -> str:
    """The answer without the header that opens it ("" while the text may still become one)."""
    for header in style.answer_starts:
        if text.startswith(header):
            return text[len(header):]
    if not finished and any(h.startswith(text) for h in style.answer_starts):
        return ""
    return text


def _split_block(style: ReasoningStyle, text: str, finished: bool) -> Optional[tuple]:
    stripped = text.lstrip()
    if stripped.startswith(style.start):
        body = stripped[len(style.start) :]
    elif not finished and style.start.startswith(stripped):
        return None  # empty, whitespace, or a partial "<think>"
    elif style.starts_in_reasoning:
        body = text
    else:
        return None, text
    idx = body.find(style.end)
    if idx >= 0:
        return body[:idx], body[idx + len(style.end) :]
    if finished:
        return body, None
    hold = _partial_suffix(body, style.end)
    return body[: len(body) - hold], None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of marker that ends text."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """One style bound to a tokenizer (for the marker token ids)."""

    def __init__(self, style: ReasoningStyle, tokenizer):
        self.style = style
        self.end_ids = tuple(tokenizer.encode(style.end, add_special_tokens=False)) if tokenizer else ()
        # what a budget forces when the reasoning runs long: the end marker, then the answer's header
        closing = style.end + (style.answer_starts[0] if style.answer_starts else "")
        self.close_ids = tuple(tokenizer.encode(closing, add_special_tokens=False)) if tokenizer else ()
        self.start_ids = tuple(tokenizer.encode(style.start, add_special_tokens=False)) if tokenizer else ()

    def split(self, text: str) -> tuple:
        """(reasoning or None, answer or None) of a finished output."""
        reasoning, answer = _split(self.style, text, True)
        return (reasoning or None) if reasoning is not None else None, answer or None

    def streamer(self) -> "ReasoningStreamer":
        return ReasoningStreamer(self.style)

    def count_tokens(self, text: str, token_ids: Sequence[int]) -> int:
        """Output tokens spent reasoning: up to the end marker's tokens, all of them if it never came."""
        reasoning, _ = _split(self.style, text, True)
        if reasoning is None:
            return 0
        end = self.end_ids
        for i in range(len(token_ids) - len(end) + 1):
            if end and tuple(token_ids[i : i + len(end)]) == end:
                return i + len(end)
        return len(token_ids)

    def budget(self, max_tokens: Optional[int]) -> Optional[ThinkingBudget]:
        """The thinking budget of a request (None: no limit)."""
        if max_tokens is None:
            return None
        if not self.end_ids:
            raise InvalidParameterError(
                "max_reasoning_tokens", "a reasoning budget needs the model's tokenizer"
            )
        start = () if self.style.starts_in_reasoning else self.start_ids
        return ThinkingBudget(max_tokens=max_tokens, end_token_ids=self.close_ids, start_token_ids=start)


class ReasoningStreamer:
    """Deltas (reasoning, answer) of a growing output text; see the module docstring."""

    def __init__(self, style: ReasoningStyle):
        self.style = style
        self.sent_reasoning = ""
        self.sent_answer = ""

    def feed(self, text: str, finished: bool) -> tuple:
        parts = _split(self.style, text, finished)
        if parts is None:
            return "", ""
        reasoning, answer = parts[0] or "", parts[1] or ""
        dr = reasoning[len(self.sent_reasoning) :] if reasoning.startswith(self.sent_reasoning) else ""
        da = answer[len(self.sent_answer) :] if answer.startswith(self.sent_answer) else ""
        self.sent_reasoning += dr
        self.sent_answer += da
        return dr, da


def make_reasoning_parser(name: Optional[str], tokenizer) -> Optional[ReasoningParser]:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    return ReasoningParser(PARSERS[name], tokenizer)
