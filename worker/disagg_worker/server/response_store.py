"""Stored responses of the Responses API, for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

Bounded twice: at most `max_entries` responses (the oldest go first) and none older than `max_age_s`. A
request with `store: false` is not kept. Each entry holds the response as answered and the conversation it
continues: the input items of every earlier turn, then its own input and output, so that a follow-up's
prompt is that conversation plus its own input (an earlier turn's `instructions` are not carried, as
OpenAI has it). The store is one process's memory: the router keeps it in front of P/D workers (a
follow-up may land on any pair), a monolithic server its own; router replicas do not share it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from disagg_api import router_settings as R
from disagg_worker.request.errors import APIError

DEFAULT_MAX_ENTRIES = R.RESPONSES_STORE_SIZE.default
DEFAULT_MAX_AGE_S = R.RESPONSES_STORE_TTL.default


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object as answered
    conversation: list[dict]  # input items of this and every earlier turn, then this turn's output items
    at: float


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    code = "previous_response_not_found" if param else "not_found"
    return APIError(404, f"{what} with id '{response_id[:80]}' not found.", param=param, code=code)


class ResponseStore:
    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict, input_items: list[dict]) -> None:
        """Keep `response` (unless it says `store: false`) with the input items it answered."""
        if response.get("store") is False or self.max_entries <= 0:
            return
        conversation = [*input_items, *response.get("output", [])]
        self._entries[response["id"]] = Stored(response, conversation, self.clock())
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response; a 404 (naming `param`, for a `previous_response_id`) when unknown or expired."""
        self._expire()
        found = self._entries.get(response_id)
        if found is None:
            raise not_found(response_id, param)
        return found

    def delete(self, response_id: str) -> dict:
        self.get(response_id)
        del self._entries[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    def _expire(self) -> None:
        cutoff = self.clock() - self.max_age_s
        while self._entries:
            key, first = next(iter(self._entries.items()))
            if first.at >= cutoff:
                return
            del self._entries[key]

    def continued(self, body: dict) -> list[dict] | None:
        """The conversation a request's `previous_response_id` continues (None without one)."""
        prev = body.get("previous_response_id")
        if prev is None:
            return None
        if not isinstance(prev, str):
            raise APIError(400, "previous_response_id: must be a string", param="previous_response_id")
        return list(self.get(prev, "previous_response_id").conversation)
