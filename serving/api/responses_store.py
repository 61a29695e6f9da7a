"""The store of `/v1/responses`: responses kept for `previous_response_id` and `GET /v1/responses/{id}`.

In memory, bounded twice: at most `max_entries` responses (the oldest goes
first) and each for at most `ttl_s` seconds after it was stored, so a
server that stores every response (OpenAI's default `store: true`) holds a
fixed amount of memory however long it runs. Every entry belongs to the API
key that stored it: another key (or no key) reads a 404, exactly as for an id
that was never stored, so one client cannot learn or continue another's
conversation. With `max_entries` 0 nothing is stored and `store: true` is
refused.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from typing import Any, Callable, Optional

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 3600.0


def owner_of(api_key: Optional[str]) -> str:
    """The scope of a request's API key (a digest, so the store never holds the key itself)."""
    if api_key is None:
        return "open"
    return hashlib.sha256(b"ridgeline responses\0" + api_key.encode("utf-8")).hexdigest()


class ResponseStore:
    """Stored responses by (owner, id), with a size cap and a time to live."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        if max_entries < 0 or ttl_s <= 0:
            raise ValueError(f"responses store: max_entries must be >= 0 and ttl_s > 0, got {max_entries}, {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: collections.OrderedDict[tuple[str, str], tuple[float, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            key, (deadline, _) = next(iter(self._entries.items()))
            if deadline > now:
                break
            del self._entries[key]

    def put(self, owner: str, response_id: str, entry: Any) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._expire()
            self._entries.pop((owner, response_id), None)
            self._entries[(owner, response_id)] = (self._clock() + self.ttl_s, entry)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, owner: str, response_id: str) -> Optional[Any]:
        with self._lock:
            self._expire()
            found = self._entries.get((owner, response_id))
            return None if found is None else found[1]

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._entries.pop((owner, response_id), None) is not None
