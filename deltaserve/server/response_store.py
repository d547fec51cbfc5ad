"""Bounded in-memory store of completed /v1/responses, for `previous_response_id` and GET by id.

Least recently used entries are evicted beyond `capacity`; a capacity of 0 stores nothing. A stored
entry is immutable: a follow-up response builds a new history list rather than extending the old one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: Any  # the ResponseObject as returned to the client
    history: tuple[dict[str, Any], ...]  # chat messages of the whole conversation, instructions excluded


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
