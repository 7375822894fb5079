"""The Responses API's stored responses (`store`, `previous_response_id`, GET and DELETE
/v1/responses/{id}): in the HTTP front end's memory, which is one process (the ranks never see
them), so they are lost on restart. At most --responses-store-size are kept, the oldest evicted
first; 0 keeps none."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as GET returns it
    conversation: list[dict[str, Any]]  # its input items (after its own previous ones), then its output


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"a response store holds >= 0 responses, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep `response` (whose input was `items`), evicting the oldest beyond the capacity."""
        if self.capacity == 0:
            return
        conversation = [*items, *response["output"]]
        self._responses[response["id"]] = StoredResponse(response, conversation)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
