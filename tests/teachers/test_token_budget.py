"""The bound on prompt tokens in flight: never exceeded by requests that fit it, a request larger
than the whole budget goes alone, a waiter gives up at its deadline or on cancel."""
from __future__ import annotations

import threading
import time

from megatron_rl_patches.teachers.served.budget import TokenBudget


def test_tokens_in_flight_stay_within_the_budget():
    budget, peak, lock = TokenBudget(100), [0], threading.Lock()
    cancel = threading.Event()

    def request(tokens: int) -> None:
        assert budget.acquire(tokens, time.monotonic() + 30, cancel)
        with lock:
            peak[0] = max(peak[0], budget.in_flight)
        time.sleep(0.01)
        budget.release(tokens)

    threads = [threading.Thread(target=request, args=(tokens,)) for tokens in [40, 30, 50, 60, 20, 70] * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 0 < peak[0] <= 100 and budget.in_flight == 0


def test_a_request_over_the_budget_goes_alone_and_a_waiter_gives_up():
    budget, cancel = TokenBudget(100), threading.Event()
    assert budget.acquire(250, time.monotonic() + 1, cancel)  # nothing else in flight: it goes
    start = time.monotonic()
    assert not budget.acquire(10, time.monotonic() + 0.3, cancel)  # waits, then the deadline
    assert 0.25 < time.monotonic() - start < 5
    cancel.set()
    assert not budget.acquire(10, time.monotonic() + 30, cancel)  # cancelled: at once
    budget.release(250)
    assert budget.acquire(10, time.monotonic() + 1, cancel)
