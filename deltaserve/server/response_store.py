"""Bounded in-memory store of completed /v1/responses, for `previous_response_id` and GET by id.

Least recently used entries are evicted beyond `capacity`; a capacity of 0 stores nothing. A stored
entry is immutable: a follow-up response builds a new history list rather than extending the old one.
With several API server processes (--api-server-count) each holds its own store; an id names the
process that minted it, so a lookup elsewhere says where the response is instead of "not found" alone.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: Any  # the ResponseObject as returned to the client
    history: tuple[dict[str, Any], ...]  # chat messages of the whole conversation, instructions excluded


class ResponseStore:
    def __init__(self, capacity: int, process_index: int = 0, process_count: int = 1) -> None:
        self.capacity = capacity
        self._index, self._count = process_index, process_count
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def new_id(self) -> str:
        """resp_<32 hex>; with several API server processes resp_p<index>_<32 hex>."""
        token = uuid.uuid4().hex
        return f"resp_{token}" if self._count == 1 else f"resp_p{self._index}_{token}"

    def elsewhere(self, response_id: str) -> str:
        """For a lookup that missed: where the response would be, when another process minted the id;
        else ''."""
        if self._count == 1 or not response_id.startswith("resp_p"):
            return ""
        index = response_id[len("resp_p") :].partition("_")[0]
        if not index.isdigit() or int(index) == self._index:
            return ""
        return (
            f"; it was answered by API server process {index} of {self._count}, which alone stores it "
            "(--api-server-count above 1 keeps a store per process: run one for previous_response_id chains)"
        )

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
