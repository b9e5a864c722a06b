"""The client libraries people point at a vLLM-compatible server, each used as its own docs show,
against the real server on the embedded model: langchain-openai, pydantic-ai and openai-agents (with
the Responses and the chat-completions models). These share the test extra's openai 3.x; instructor,
llama-index and guidellm need openai 2.x and run from .venv-clients (test_clients_openai2.py)."""

from __future__ import annotations

import pydantic
import pytest

from .conftest import API_KEY, MODEL

ASK = "What is the capital of France?"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class Capital(pydantic.BaseModel):
    country: str
    capital: str


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def test_langchain_openai(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, model=MODEL, temperature=0, max_tokens=64, max_retries=0
    )
    assert "Paris" in llm.invoke(ASK).content
    assert "".join(c.content for c in llm.stream(ASK)) == llm.invoke(ASK).content
    assert isinstance(llm.with_structured_output(Capital).invoke(ASK), Capital)
    calls = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?").tool_calls
    assert calls[0]["name"] == "get_weather" and isinstance(calls[0]["args"]["city"], str)
    responses = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key=API_KEY,
        model=MODEL,
        temperature=0,
        max_tokens=16,
        use_responses_api=True,
        max_retries=0,
    )
    assert "Paris" in responses.invoke(ASK).text


@pytest.mark.parametrize("model_class", ["OpenAIChatModel", "OpenAIResponsesModel"])
def test_pydantic_ai(server, model_class):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent  # optional: the test extra
    from pydantic_ai.models import openai as pai_openai  # optional: the test extra
    from pydantic_ai.providers.openai import OpenAIProvider  # optional: the test extra

    model = getattr(pai_openai, model_class)(
        MODEL, provider=OpenAIProvider(base_url=server.url + "/v1", api_key=API_KEY)
    )
    plain = Agent(model, model_settings={"temperature": 0, "max_tokens": 16})
    assert "Paris" in plain.run_sync(ASK).output
    typed = Agent(model, output_type=Capital, model_settings={"temperature": 0, "max_tokens": 96})
    assert isinstance(typed.run_sync(ASK).output, Capital)  # through a tool call that must validate


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_openai_agents(server, model_class):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # traces would go to OpenAI
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = getattr(agents, model_class)(model=MODEL, openai_client=client)
    plain = agents.Agent(
        name="plain",
        instructions=SYSTEM,
        model=model,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=16),
    )
    assert "Paris" in agents.Runner.run_sync(plain, ASK).final_output
    tool = agents.function_tool(get_weather)
    # tool_choice required for the first turn (the agent resets it after a call): the call, its output
    # back to the model, and the model's answer
    user = agents.Agent(
        name="tools",
        instructions="Use the tools.",
        tools=[tool],
        model=model,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=24, tool_choice="required"),
    )
    result = agents.Runner.run_sync(user, "What is the weather in Paris?", max_turns=3)
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and "MessageOutputItem" in kinds
