"""The first apply() racing in several threads of a cold process builds one registry, so revert()
removes every wrapper; the other lazily built process state (Ray's arming, warn_once) is race-free."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

THREADS = 8

# A cold process: the default registry is not built yet. Registry construction is slowed down so
# that every thread is inside it before any finishes, the first one longest: without a lock the
# others' registries install the wrappers and the first one's, kept last as the default, finds
# them "already wrapped" and cannot remove them (the race, forced on every run).
COLD_APPLY = textwrap.dedent(
    f"""
    import json, threading, time
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel as DDP
    original = DDP.__dict__["enable_forward_pre_hook"]
    from megatron_rl_patches.patching import registry
    built = []
    real_init = registry.Registry.__init__
    def slow_init(self, *args, **kwargs):
        built.append(self)
        time.sleep(1.5 if len(built) == 1 else 0.2)
        real_init(self, *args, **kwargs)
    registry.Registry.__init__ = slow_init
    import megatron_rl_patches as mrp
    start = threading.Barrier({THREADS})
    def worker():
        start.wait()
        mrp.apply()
    threads = [threading.Thread(target=worker) for _ in range({THREADS})]
    for t in threads: t.start()
    for t in threads: t.join()
    patched = DDP.__dict__["enable_forward_pre_hook"] is not original
    status = {{s.target: s.status for s in mrp.applied() if s.name == "ddp_hooks"}}
    mrp.revert()
    print(json.dumps({{"built": len(built), "patched": patched, "status": status,
                      "restored": DDP.__dict__["enable_forward_pre_hook"] is original}}))
    """
)


@pytest.mark.megatron
def test_cold_apply_from_eight_threads_then_revert_restores_the_original():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run([sys.executable, "-c", COLD_APPLY], env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["restored"], report
    assert report["built"] == 1, report
    assert report["patched"] and set(report["status"].values()) == {"applied"}, report


def _race(target, *args) -> None:
    """`target(*args)` from THREADS threads released at once."""
    start = threading.Barrier(THREADS)

    def worker():
        start.wait()
        target(*args)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_ray_disarm_racing_arm_leaves_ray_init_unwrapped(monkeypatch):
    """revert() while another thread's apply() is arming: ray.init must end up itself again."""
    import types

    import wrapt

    from megatron_rl_patches.integrations import _ray as ray_integration

    monkeypatch.setattr(wrapt, "register_post_import_hook", lambda hook, name: None)
    fake_ray = types.ModuleType("ray")
    fake_ray.init = plain_init = lambda **kwargs: "ray started"
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(ray_integration, "_state", {"armed": False, "hooked": False})
    real_is_ours = ray_integration._is_ours
    checking = threading.Event()

    def slow_is_ours(init):  # arm() has read ray.init and not wrapped it yet
        found = real_is_ours(init)
        checking.set()
        time.sleep(0.3)
        return found

    monkeypatch.setattr(ray_integration, "_is_ours", slow_is_ours)
    arming = threading.Thread(target=ray_integration.arm)
    arming.start()
    checking.wait(5)
    monkeypatch.setattr(ray_integration, "_is_ours", real_is_ours)
    ray_integration.disarm()
    arming.join()
    left, armed = fake_ray.init, ray_integration._state["armed"]
    ray_integration.disarm()
    assert left is plain_init and not armed  # the later call, disarm, wins whole


def test_warn_once_warns_once_from_many_threads(monkeypatch, caplog):
    from megatron_rl_patches import _log

    monkeypatch.setattr(_log, "_warned", set())
    real_rank_zero = _log.is_rank_zero

    def slow_rank_zero():  # sits between the check and the warning
        time.sleep(0.05)
        return real_rank_zero()

    monkeypatch.setattr(_log, "is_rank_zero", slow_rank_zero)
    real_contains = set.__contains__

    class SlowSet(set):
        def __contains__(self, item):
            found = real_contains(self, item)
            time.sleep(0.05)
            return found

    monkeypatch.setattr(_log, "_warned", SlowSet())
    with caplog.at_level("WARNING", logger="megatron_rl_patches"):
        _race(_log.warn_once, "a message raced by eight threads")
    assert [r.getMessage() for r in caplog.records].count("megatron-rl-patches: a message raced by eight threads") == 1
