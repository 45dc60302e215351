"""A replica kept out is named once per reason, not at every re-check (issue 96 item 10): one
warning line when it is taken out (another checkpoint behind its URL), none while each later
re-check finds the same, one when it is refused again for another reason (down), one when it is
back. Endpoints in memory, re-checked every step (`recheck_s` short)."""
from __future__ import annotations

import logging
import time

from megatron_rl_patches.teachers import ReplicaSettings
from megatron_rl_patches.teachers.served.pool import ReplicaPool
from tests.teachers.served.memory_endpoints import MemoryEndpoint, failing
from tests.teachers.served.test_replica_recheck import RECHECK_S, connect, reference, same, step_of

LOGGER = "megatron_rl_patches.teachers.served"
STEPS = 4  # steps (each a re-check of the replica out) per state


def steps_with_checks(pool: ReplicaPool, replica: MemoryEndpoint) -> None:
    """`STEPS` steps, each after `recheck_s`, each waited until the replica's re-check came back."""
    for _ in range(STEPS):
        time.sleep(2 * RECHECK_S)
        checks = replica.checks
        assert same(step_of(pool), reference())
        until = time.monotonic() + 10
        while (replica.checks == checks or pool.scheduler.checking) and time.monotonic() < until:
            time.sleep(0.005)


def test_a_replica_kept_out_is_named_once_per_reason_and_once_back(caplog):
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None, recheck_s=RECHECK_S))
    connect(pool)
    assert same(step_of(pool), reference()) and b.asked
    lines: list[list[str]] = []
    for state in ("other weights", "down", "back"):
        if state == "other weights":
            b.offset = 0.5  # restarted behind its URL with another checkpoint
        elif state == "down":
            b.fails = failing("http://b")
        else:
            b.fails, b.offset = None, 0.0
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            steps_with_checks(pool, b)
        lines.append([r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "http://b" in
                      r.getMessage()])
    taken, down, back = lines
    assert len(taken) == 1 and "scores the probe other than" in taken[0] and "taken out" in taken[0], taken
    assert len(down) == 1 and "kept out at its re-check" in down[0] and "ConnectError" in down[0], down
    assert len(back) == 1 and "replica http://b is back" in back[0], back
    assert b.checks >= 1 + 3 * STEPS - 1  # re-checked at (nearly) every step: not one line per check
    pool.close()
