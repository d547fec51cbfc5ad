"""Parsed output deltas -> Responses output items and the streaming events announcing them.

One builder per response, used by the streaming and the non-streaming path alike. Invariants: at most
one item is open (being appended to); a new kind of output (reasoning, text, a new tool call) closes it
first, so every item gets its `added` ... `done` events in order, and `sequence_number` counts every
event of the response from 0. The last event is `response.completed` or `response.failed`. Events carry copies of items, so later appends never change them.
"""

from __future__ import annotations

import secrets

from deltaserve.server.parsers import ParsedDelta
from deltaserve.server.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    Event,
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseBuilder:
    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._seq = 0
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallItem] = {}  # parser call index -> its item

    def _event(self, event: Event) -> Event:
        event.sequence_number = self._seq
        self._seq += 1
        return event

    def _lifecycle(self, kind: str) -> Event:
        return self._event(
            ResponseEvent(type=f"response.{kind}", response=self.response.model_copy(deep=True))
        )

    def start(self) -> list[Event]:
        return [self._lifecycle("created"), self._lifecycle("in_progress")]

    def add(self, parsed: ParsedDelta) -> list[Event]:
        events: list[Event] = []
        if parsed.reasoning:
            events += self._append_text(ReasoningItem, parsed.reasoning)
        if parsed.content:
            events += self._append_text(MessageItem, parsed.content)
        for call in parsed.tool_calls:
            events += self._append_call(call.index, call.id, call.name, call.arguments)
        return events

    def finish(self, engine_reason: str | None, usage: ResponseUsage) -> list[Event]:
        complete = engine_reason != "length"
        events = self._close("completed" if complete else "incomplete")
        self.response.usage = usage
        self.response.status = "completed" if complete else "incomplete"
        if not complete:
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        # Always `response.completed` (its status says incomplete): the openai SDK's stream helper only
        # finalises on that event, and vLLM sends it the same way.
        return events + [self._lifecycle("completed")]

    def fail(self, code: str, message: str) -> list[Event]:
        events = self._close("incomplete")
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        return events + [self._lifecycle("failed")]

    # ---- items ----------------------------------------------------------------------------------

    def _open_item(self, item: OutputItem) -> list[Event]:
        self.response.output.append(item)
        self._open = item
        index = len(self.response.output) - 1
        events = [
            self._event(
                OutputItemEvent(
                    type="response.output_item.added", output_index=index, item=item.model_copy(deep=True)
                )
            )
        ]
        if isinstance(item, MessageItem | ReasoningItem):
            part = OutputText() if isinstance(item, MessageItem) else ReasoningText()
            item.content.append(part)  # type: ignore[arg-type]
            events.append(
                self._event(
                    ContentPartEvent(
                        type="response.content_part.added",
                        item_id=item.id,
                        output_index=index,
                        content_index=0,
                        part=part.model_copy(),
                    )
                )
            )
        return events

    def _append_text(self, kind: type[MessageItem] | type[ReasoningItem], text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self._open, kind):
            events += self._close("completed")
            events += self._open_item(kind(id=_new_id("msg" if kind is MessageItem else "rs")))
        item = self._open
        assert isinstance(item, MessageItem | ReasoningItem)
        item.content[0].text += text
        is_message = isinstance(item, MessageItem)
        delta = TextDeltaEvent(
            type="response.output_text.delta" if is_message else "response.reasoning_text.delta",
            item_id=item.id,
            output_index=len(self.response.output) - 1,
            content_index=0,
            delta=text,
            logprobs=[] if is_message else None,
        )
        return events + [self._event(delta)]

    def _append_call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[Event]:
        events: list[Event] = []
        if call_id is not None:
            events += self._close("completed")
            item = FunctionCallItem(id=_new_id("fc"), call_id=call_id, name=name or "")
            self._calls[index] = item
            events += self._open_item(item)
        item = self._calls[index]
        if arguments:
            item.arguments += arguments
            output_index = self.response.output.index(item)
            events.append(
                self._event(
                    ArgumentsDeltaEvent(
                        type="response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=output_index,
                        delta=arguments,
                    )
                )
            )
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status  # type: ignore[assignment]
        index = self.response.output.index(item)
        events: list[Event] = []
        if isinstance(item, FunctionCallItem):
            done = ArgumentsDoneEvent(
                type="response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            )
            events.append(self._event(done))
        else:
            part = item.content[0]
            is_message = isinstance(item, MessageItem)
            kind = "output_text" if is_message else "reasoning_text"
            done_text = TextDoneEvent(
                type=f"response.{kind}.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=[] if is_message else None,
            )
            part_done = ContentPartEvent(
                type="response.content_part.done",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=part.model_copy(),
            )
            events += [self._event(done_text), self._event(part_done)]
        done = OutputItemEvent(
            type="response.output_item.done", output_index=index, item=item.model_copy(deep=True)
        )
        return events + [self._event(done)]
