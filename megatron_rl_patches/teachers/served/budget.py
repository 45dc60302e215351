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

    def fits(self, tokens: int) -> bool:
        """Whether `tokens` fit now beside those in flight (alone, anything fits)."""
        return not self.in_flight or self.in_flight + tokens <= self.limit

    def take(self, tokens: int) -> bool:
        """Take `tokens` now where they fit (True), else nothing (False): never waits."""
        with self._changed:
            if not self.fits(tokens):
                return False
            self.in_flight += tokens
            return True

    def acquire(self, tokens: int, until: float, cancel: threading.Event) -> bool:
        """Take `tokens` (True), or give up at the monotonic time `until` or on `cancel` (False)."""
        with self._changed:
            while not self.fits(tokens):
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
