"""Stored responses of the Responses API, for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

Bounded three ways: at most `max_entries` responses and `max_bytes` of them (the oldest go first; one alone
larger than that is not kept), and none older than `max_age_s`. A request with `store: false` is not kept.
Each entry holds the response as answered and the conversation it continues: the input items of every
earlier turn, then its own input and output, so that a follow-up's prompt is that conversation plus its own
input (an earlier turn's `instructions` are not carried, as OpenAI has it). Both are kept as their JSON,
which is what the bound counts (a parsed body takes several times its bytes in memory).

A response belongs to the caller that made it (`http.auth.caller_of`: the API key it was let in with):
another caller's `GET`, `DELETE` or `previous_response_id` of its id is a 404, as if it did not exist. Where
the server takes no keys every request is the same caller.

The store is one process's memory: the router keeps it in front of P/D workers (a follow-up may land on any
pair), a monolithic server its own; router replicas do not share it.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from disagg_api import router_settings as R
from disagg_worker.request.errors import APIError

log = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = R.RESPONSES_STORE_SIZE.default
DEFAULT_MAX_BYTES = R.RESPONSES_STORE_BYTES.default
DEFAULT_MAX_AGE_S = R.RESPONSES_STORE_TTL.default


@dataclass(frozen=True)
class Stored:
    response_json: bytes  # the response object as answered
    conversation_json: bytes  # input items of this and every earlier turn, then this turn's output items
    owner: str
    at: float

    @property
    def nbytes(self) -> int:
        return len(self.response_json) + len(self.conversation_json)

    @property
    def response(self) -> dict:
        return json.loads(self.response_json)

    @property
    def conversation(self) -> list[dict]:
        return json.loads(self.conversation_json)


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
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.nbytes = 0  # of every entry kept

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict, input_items: list[dict], owner: str = "") -> None:
        """Keep `response` (unless it says `store: false`) with the input items it answered, as `owner`'s."""
        if response.get("store") is False or self.max_entries <= 0:
            return
        conversation = [*input_items, *response.get("output", [])]
        entry = Stored(_json(response), _json(conversation), owner, self.clock())
        if entry.nbytes > self.max_bytes:
            log.warning(
                "response %s not stored: %d bytes, over the store's %d", response["id"], entry.nbytes, self.max_bytes
            )
            return
        self._drop(response["id"])
        self._entries[response["id"]] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str, param: str | None = None, owner: str = "") -> Stored:
        """The stored response; a 404 (naming `param`, for a `previous_response_id`) when unknown, expired, or
        another caller's."""
        self._expire()
        found = self._entries.get(response_id)
        if found is None or found.owner != owner:
            raise not_found(response_id, param)
        return found

    def delete(self, response_id: str, owner: str = "") -> dict:
        self.get(response_id, owner=owner)
        self._drop(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _drop(self, response_id: str) -> None:
        gone = self._entries.pop(response_id, None)
        if gone is not None:
            self.nbytes -= gone.nbytes

    def _expire(self) -> None:
        cutoff = self.clock() - self.max_age_s
        while self._entries:
            key, first = next(iter(self._entries.items()))
            if first.at >= cutoff:
                return
            self._drop(key)

    def continued(self, body: dict, owner: str = "") -> list[dict] | None:
        """The conversation a request's `previous_response_id` continues (None without one)."""
        prev = body.get("previous_response_id")
        if prev is None:
            return None
        if not isinstance(prev, str):
            raise APIError(400, "previous_response_id: must be a string", param="previous_response_id")
        return self.get(prev, "previous_response_id", owner).conversation


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
