"""Pydantic models of the OpenAI Responses API wire format (/v1/responses): request, output items,
the response object and the streaming events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltaserve.server.protocol import DropNone, SamplingFields, StrictModel, now

ItemStatus = Literal["in_progress", "completed", "incomplete"]
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class TextFormat(StrictModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(StrictModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat = Field(default_factory=TextFormat)


class NamedFunctionChoice(StrictModel):
    type: Literal["function"] = "function"
    name: str


class InputItem(StrictModel):
    """One `input` item: a message (type omitted or "message"), function_call, function_call_output or
    reasoning. Loose on purpose: responses_items.py checks each kind and names the item at fault."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    store: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- output items ------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True

    @property
    def output_text(self) -> str:
        return "".join(p.text for item in self.output if isinstance(item, MessageItem) for p in item.content)


# ---- streaming events --------------------------------------------------------------------------


class Event(DropNone):
    type: str
    sequence_number: int = 0


class ResponseEvent(Event):  # response.created | in_progress | completed | incomplete | failed
    response: ResponseObject


class OutputItemEvent(Event):  # response.output_item.added | done
    output_index: int
    item: OutputItem


class ContentPartEvent(Event):  # response.content_part.added | done
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(Event):  # response.output_text.delta | response.reasoning_text.delta
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] | None = None


class TextDoneEvent(Event):  # response.output_text.done | response.reasoning_text.done
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] | None = None


class ArgumentsDeltaEvent(Event):  # response.function_call_arguments.delta
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Event):  # response.function_call_arguments.done
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(Event):
    type: str = "error"
    code: str | int | None = None
    message: str
    param: str | None = None
