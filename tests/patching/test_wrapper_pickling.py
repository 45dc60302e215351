"""Patched functions pickle, copy and deep-copy like their originals (Ray and multiprocessing
pickle such objects): a wrapper reduces by reference to the path of what it wraps."""
from __future__ import annotations

import copy
import importlib
import inspect
import json
import os
import pickle
import subprocess
import sys
import textwrap
import types

import pytest

from megatron_rl_patches.patching.registry import Patch, Registry

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)

STANDIN = '''
class Engine:
    def __init__(self, tag):
        self.tag = tag

    def step(self, n):
        return ("original", self.tag, n)


def train(rollout_id):
    return ("original", rollout_id)
'''


def passthrough(wrapped, instance, args, kwargs):
    return ("wrapped", wrapped(*args, **kwargs))


@pytest.fixture
def standin(tmp_path, monkeypatch):
    name = f"pickling_standin_{os.getpid()}_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text(STANDIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    originals = (module.train, vars(module.Engine)["step"])
    registry = Registry([Patch("p", f"{name}:train", passthrough, "d", requires=None),
                         Patch("p", f"{name}:Engine.step", passthrough, "d", requires=None)])
    registry.apply()
    yield module, originals
    registry.reset()
    sys.modules.pop(name, None)


def test_a_patched_function_pickles_by_reference(standin):
    module, (train, _) = standin
    assert module.train is not train and module.train(1) == ("wrapped", ("original", 1))
    for protocol in PROTOCOLS:
        assert pickle.loads(pickle.dumps(module.train, protocol)) is module.train
    assert copy.copy(module.train) is module.train and copy.deepcopy(module.train) is module.train


def test_a_patched_method_pickles_like_the_original_from_the_class_and_bound(standin):
    module, (_, step) = standin
    engine = module.Engine("e")
    for protocol in PROTOCOLS:
        assert inspect.unwrap(pickle.loads(pickle.dumps(module.Engine.step, protocol))) is step
        bound = pickle.loads(pickle.dumps(engine.step, protocol))  # like a bound method: a copy of its object
        assert bound.__self__.tag == "e" and bound.__self__ is not engine
        assert bound(2) == ("wrapped", ("original", "e", 2))
    assert inspect.unwrap(copy.deepcopy(module.Engine.step)) is step
    deep = copy.deepcopy(engine.step)
    assert deep.__self__ is not engine and deep(3) == ("wrapped", ("original", "e", 3))
    shallow = copy.copy(engine.step)
    assert shallow.__self__ is engine and shallow(4) == ("wrapped", ("original", "e", 4))


def test_ray_init_wrapper_pickles_by_reference(monkeypatch):
    from megatron_rl_patches.integrations import _ray as ray_integration

    fake_ray = types.ModuleType("ray")

    def init(**kwargs):
        return "ray started"

    init.__module__, init.__qualname__ = "ray", "init"
    fake_ray.init = init
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(ray_integration, "_state", {"armed": False, "hooked": True})
    ray_integration.arm()
    try:
        assert fake_ray.init is not init
        assert pickle.loads(pickle.dumps(fake_ray.init)) is fake_ray.init
        assert copy.deepcopy(fake_ray.init) is fake_ray.init
    finally:
        ray_integration.disarm()


@pytest.mark.megatron
def test_patched_gpt_forward_pickles_in_process():
    from megatron.core.models.gpt.gpt_model import GPTModel

    import megatron_rl_patches as mrp

    original = vars(GPTModel)["forward"]
    mrp.apply(only="gpt_output_processor")
    if vars(GPTModel)["forward"] is original:
        pytest.skip("this megatron-core has output_processor natively: nothing is wrapped")
    for protocol in PROTOCOLS:
        for obj in (GPTModel.forward, vars(GPTModel)["forward"]):
            assert inspect.unwrap(pickle.loads(pickle.dumps(obj, protocol))) is original
    assert inspect.unwrap(copy.deepcopy(GPTModel.forward)) is original
    assert inspect.unwrap(copy.copy(GPTModel.forward)) is original
    mrp.revert()
    assert pickle.loads(pickle.dumps(GPTModel.forward)) is original


CHILD = textwrap.dedent(
    """
    import copy, json, pickle
    import megatron.core.models.gpt.gpt_model as g
    wrapped = hasattr(g.GPTModel.forward, "__wrapped__")
    loaded = pickle.loads(pickle.dumps(g.GPTModel.forward))
    deep = copy.deepcopy(g.GPTModel.forward)
    same = lambda f: getattr(f, "__wrapped__", f) is getattr(g.GPTModel.forward, "__wrapped__", g.GPTModel.forward)
    print(json.dumps({"wrapped": wrapped, "pickled": same(loaded), "deepcopied": same(deep)}))
    """
)


@pytest.mark.megatron
def test_patched_gpt_forward_pickles_under_start_up_patching():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ["MEGATRON_RL_PATCHES"], environ["PYTHONWARNINGS"] = "all", "ignore"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", "run", "--", sys.executable, "-c", CHILD],
                          env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    from megatron_rl_patches.integrations.megatron.version import megatron_info

    if not report["wrapped"]:
        pytest.skip(f"megatron-core {megatron_info().version} has output_processor natively: nothing is wrapped")
    assert report == {"wrapped": True, "pickled": True, "deepcopied": True}
