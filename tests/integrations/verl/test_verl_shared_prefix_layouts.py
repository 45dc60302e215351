"""verl's layouts a sharing plan cannot run are named before any plan is built
(`integrations/verl/shared_prefix.verl_layout_reasons`), read from verl's engine settings and
megatron-core's parallel state. Context parallelism above all: verl's `preprocess_thd_engine` hands
each rank its share of the packed ids, and a plan built from a share as if it were the whole
micro-batch would be wrong. The lane (tests/integrations/verl/lane/test_verl_layouts.py) runs the
refusal on verl's real engine over two ranks; here each reason alone, megatron-core's sizes set."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.megatron


def engine(**config):
    engine_config = SimpleNamespace(use_remove_padding=True, dynamic_context_parallel=False,
                                    router_replay=SimpleNamespace(mode="disabled"))
    for key, value in config.items():
        setattr(engine_config, key, value)
    return SimpleNamespace(engine_config=engine_config, model_config=SimpleNamespace(hf_config=None, mtp=None))


@pytest.fixture
def sizes(monkeypatch):
    from megatron.core import parallel_state

    chosen = {"cp": 1, "pp": 1}
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: chosen["cp"])
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: chosen["pp"])
    return chosen


def test_a_plain_layout_has_no_reason(sizes):
    from megatron_rl_patches.integrations.verl.shared_prefix import verl_layout_reasons

    assert verl_layout_reasons(engine()) == []


@pytest.mark.parametrize(("size", "config", "named"), [
    ("cp", {}, "context parallelism (context_parallel_size=2)"),
    ("pp", {}, "pipeline parallelism (pipeline_model_parallel_size=2)"),
    (None, {"use_remove_padding": False}, "use_remove_padding=False"),
    (None, {"dynamic_context_parallel": True}, "dynamic_context_parallel=True"),
])
def test_each_layout_a_plan_cannot_run_is_named(sizes, size, config, named):
    from megatron_rl_patches.integrations.verl.shared_prefix import verl_layout_reasons

    if size:
        sizes[size] = 2
    reasons = verl_layout_reasons(engine(**config))
    assert len(reasons) == 1 and named in reasons[0], reasons
