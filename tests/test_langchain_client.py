"""A third-party client as users run it: langchain-openai's ChatOpenAI against the real server (invoke,
stream, bind_tools, with_structured_output). Thinking is off server-wide with
--default-chat-template-kwargs, as a deployment serving such clients would set it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from server_fixture import MODEL, ServerProcess, running_server


class Verdict(BaseModel):
    """Whether it is sunny, and how much."""

    sunny: bool
    score: int = Field(ge=0, le=9)


@tool
def get_weather(unit: Literal["c", "f"]) -> str:
    """The weather in Paris, in the given unit."""
    return "21" if unit == "c" else "70"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--default-chat-template-kwargs", '{"enable_thinking": false}') as s:
        yield s


@pytest.fixture(scope="module")
def chat(server: ServerProcess) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=server.base_url, api_key="none", model=MODEL, temperature=0, max_tokens=60, max_retries=0
    )


def test_invoke_and_stream(chat: ChatOpenAI) -> None:
    answer = chat.invoke("Is it sunny in Paris?")
    assert isinstance(answer.content, str) and answer.content
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0
    streamed = "".join(str(chunk.content) for chunk in chat.stream("Is it sunny in Paris?"))
    assert streamed == answer.content


def test_bind_tools_with_a_forced_tool(chat: ChatOpenAI) -> None:
    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    (call,) = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and call["args"]["unit"] in ("c", "f")
    assert get_weather.invoke(call["args"]) in ("21", "70")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat: ChatOpenAI, method: str) -> None:
    verdict = chat.with_structured_output(Verdict, method=method).invoke("Is it sunny in Paris?")  # type: ignore[arg-type]
    assert isinstance(verdict, Verdict) and 0 <= verdict.score <= 9
