"""Run by tests/server/test_clients_openai2.py with .venv-clients' Python (openai 2.x): instructor
(tools and JSON schema modes) and llama-index's OpenAILike (complete, chat, stream) against the
server at argv[1]; prints one JSON object of what each returned."""

import json
import sys

import instructor
import openai
import pydantic
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

base_url, api_key, model = sys.argv[1:4]
ASK = "What is the capital of France?"


class Capital(pydantic.BaseModel):
    country: str
    capital: str


out = {}
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
for mode in ("TOOLS", "JSON_SCHEMA"):
    ic = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    r = ic.chat.completions.create(
        model=model,
        response_model=Capital,
        max_retries=0,
        temperature=0,
        max_tokens=64,
        messages=[{"role": "user", "content": ASK}],
    )
    out[f"instructor_{mode}"] = r.model_dump()
llm = OpenAILike(
    model=model,
    api_base=base_url,
    api_key=api_key,
    is_chat_model=True,
    temperature=0,
    max_tokens=16,
    context_window=8192,
)
out["llama_complete"] = llm.complete(ASK).text
out["llama_chat"] = llm.chat([ChatMessage(role="user", content=ASK)]).message.content
out["llama_stream"] = "".join(c.delta or "" for c in llm.stream_chat([ChatMessage(role="user", content=ASK)]))
print(json.dumps(out))
