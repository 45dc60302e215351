"""A bound on the prompt tokens in flight at once (`TokenBudget`): a request waits until its
tokens fit beside those in flight; one larger than the whole budget goes when nothing else is."""
from __future__ import annotations

import threading
import time


class TokenBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._changed = threading.Condition()

    def acquire(self, tokens: int, until: float, cancel: threading.Event) -> bool:
        """Take `tokens` (True), or give up at the monotonic time `until` or on `cancel` (False)."""
        with self._changed:
            while self.in_flight and self.in_flight + tokens > self.limit:
                left = until - time.monotonic()
                if left <= 0 or cancel.is_set():
                    return False
                self._changed.wait(min(left, 0.1))
            self.in_flight += tokens
            return True

    def release(self, tokens: int) -> None:
        with self._changed:
            self.in_flight -= tokens
            self._changed.notify_all()
