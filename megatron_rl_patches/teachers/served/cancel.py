"""A cancel that others react to (`Cancel`): an event whose setting runs what was waiting on it
(`on_set`) and sets its children (`Cancel(parent)`: a request's cancel is set with its step's).
Nothing polls it: a step that fails stops its requests at once, and a request answered elsewhere
stops its copy without touching the step."""
from __future__ import annotations

import threading
from collections.abc import Callable


class Cancel(threading.Event):
    """`set()` once: every callback given to `on_set` runs (in the setting thread), every child
    is set; a callback given after it was set runs at once."""

    def __init__(self, parent: Cancel | None = None) -> None:
        super().__init__()
        self._guard = threading.Lock()
        self._callbacks: list[Callable[[], object]] = []
        if parent is not None:
            parent.on_set(self.set)

    def on_set(self, callback: Callable[[], object]) -> None:
        with self._guard:
            if not self.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def set(self) -> None:
        with self._guard:
            if self.is_set():
                return
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
