"""Structured outputs: a request's grammar (JSON schema, any JSON object, regex, choice, EBNF) compiled
once, a matcher per sample that follows its tokens, and the batch's token masks applied to the
logits before sampling.

  compiler.py  GrammarCompiler: StructuredOutput -> compiled grammar (xgrammar, cached), errors -> 400
  matcher.py   Matcher (one sample's state), apply_grammar_masks (the whole batch, one bitmask)

The grammar engine is xgrammar, chosen by measured per-token mask time on this CPU (docs/BENCHMARKS.md
"Grammar masks"). The grammar lets EOS through only where the output is complete, and JSON allows
no free whitespace, so a small model cannot wander in blank space until max_tokens.
"""

from servescope.structured.compiler import GrammarCompiler
from servescope.structured.matcher import Matcher, apply_grammar_masks

__all__ = ["GrammarCompiler", "Matcher", "apply_grammar_masks"]
