"""Which worker holds which stored `/v1/responses` answer, so a `previous_response_id` goes back to it.

A worker keeps its responses in its own memory (`serving.api.responses_store`):
another worker has never seen the id and cannot continue the conversation. The
router remembers the worker of every response it relayed, up to a bound (least
recently used ids go first); an id it does not remember (evicted, or relayed
before a router restart) is looked up by asking the workers
(`RouterService.find_owner`), which costs a round of GETs, not a wrong answer.
"""

from __future__ import annotations

import collections
import json
from typing import Optional

DEFAULT_MAX_ENTRIES = 100_000  # ids remembered; an entry is an id and a URL, ~200 bytes
_SCAN_LIMIT = 64 * 1024  # bytes of a stream searched for its `response.created` event


class ResponseOwners:
    """A bounded map response id -> worker URL, least recently used evicted first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._owners: collections.OrderedDict[str, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def remember(self, response_id: str, worker: str) -> None:
        self._owners[response_id] = worker
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> Optional[str]:
        worker = self._owners.get(response_id)
        if worker is not None:
            self._owners.move_to_end(response_id)
        return worker

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)


def response_id_of(content: bytes) -> Optional[str]:
    """The `id` of a non-streamed Responses answer (None for an error or anything else)."""
    try:
        body = json.loads(content)
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("object") == "response" and isinstance(body.get("id"), str):
        return body["id"]
    return None


class StreamIdScanner:
    """Finds a streamed response's id in its first event (`response.created`) as chunks are relayed.

    Chunks pass through untouched; only the first `_SCAN_LIMIT` bytes are kept and searched, so a
    stream without the event costs a bounded buffer.
    """

    def __init__(self):
        self.response_id: Optional[str] = None
        self._buffer = b""
        self._done = False

    def feed(self, chunk: bytes) -> Optional[str]:
        """The id once it is found in the stream so far, else None."""
        if self._done:
            return self.response_id
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._read_line(line.strip())
            if self._done:
                break
        if len(self._buffer) > _SCAN_LIMIT:
            self._done = True
        if self._done:
            self._buffer = b""
        return self.response_id

    def _read_line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        try:
            event = json.loads(line[5:])
        except ValueError:
            return
        self._done = True  # the first data line decides: it is `response.created`, or the stream has no id
        response = event.get("response") if isinstance(event, dict) else None
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            self.response_id = response["id"]
