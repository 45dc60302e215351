"""The shared model-chunk and argument helpers (`inference.chunks`, `patching.calls`, `ops.scoring_plan`'s
`positive_int`) that reentrant, the wrappers and inference use."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

from megatron_rl_patches import reentrant
from megatron_rl_patches.inference import chunks as _chunks
from megatron_rl_patches.ops import scoring_plan
from megatron_rl_patches.patching import calls
from megatron_rl_patches.testing.fake_ddp import FakeDDP


def test_as_chunks_copies_lists_and_wraps_anything_else():
    a, b = object(), object()
    given = [a, b]
    chunks = _chunks.as_chunks(given)
    assert chunks == [a, b] and chunks is not given  # a copy: callers may not mutate the user's list
    assert _chunks.as_chunks((a, b)) == [a, b]
    assert _chunks.as_chunks(a) == [a]
    assert _chunks.as_chunks(None) == [None]  # None is a chunk here; callers giving None a meaning check first
    assert _chunks.as_chunks([]) == []


def test_module_chunks_requires_a_non_empty_list_of_modules():
    torch = pytest.importorskip("torch")
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    assert _chunks.module_chunks(first, "model") == [first]
    assert _chunks.module_chunks((first, second), "model") == [first, second]
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module or a non-empty list .* got list$"):
        _chunks.module_chunks([], "model")
    with pytest.raises(TypeError, match=r"model_chunks must be .* got list of \['Linear', 'str'\]"):
        _chunks.module_chunks([first, "x"], "model_chunks")
    with pytest.raises(TypeError, match=r"got dict$"):
        _chunks.module_chunks({"model": first}, "model")


def test_iter_wrapped_walks_module_chain_and_stops_on_cycles():
    inner = SimpleNamespace(name="inner")
    middle = SimpleNamespace(name="middle", module=inner)
    outer = SimpleNamespace(name="outer", module=middle)
    assert [m.name for m in _chunks.iter_wrapped(outer)] == ["outer", "middle", "inner"]
    assert [m.name for m in _chunks.iter_wrapped(SimpleNamespace(name="x", module=None))] == ["x"]
    assert list(_chunks.iter_wrapped(None)) == []
    inner.module = outer  # a cycle
    assert [m.name for m in _chunks.iter_wrapped(outer)] == ["outer", "middle", "inner"]
    fake = FakeDDP()  # its `.module` is itself
    assert list(_chunks.iter_wrapped(fake)) == [fake]


def test_ddp_like_and_grad_buffers_are_distinct_checks():
    fake = FakeDDP()
    assert _chunks.is_ddp_like(fake) and not _chunks.has_grad_buffers(fake)  # hooks, nothing to count
    counted = SimpleNamespace(ddp_config=SimpleNamespace(), buffers=[])
    assert _chunks.has_grad_buffers(counted) and not _chunks.is_ddp_like(counted)
    partial = SimpleNamespace(use_forward_hook=True, start_param_sync=lambda **_: None)
    assert not _chunks.is_ddp_like(partial)  # no remove_forward_pre_hook_handles
    assert reentrant.is_ddp_like is _chunks.is_ddp_like  # the name reentrant always exported


def test_unwrap_strips_only_known_wrappers(monkeypatch):
    class Wrapper:
        def __init__(self, module):
            self.module = module

    fake_module = types.ModuleType("fake_wrappers")
    fake_module.Wrapper = Wrapper
    monkeypatch.setitem(sys.modules, "fake_wrappers", fake_module)
    monkeypatch.setattr(_chunks, "_WRAPPERS", (*_chunks._WRAPPERS, ("fake_wrappers", "Wrapper")))
    model = SimpleNamespace(module=SimpleNamespace())  # `.module` but not a wrapper: kept
    assert _chunks.unwrap(Wrapper(Wrapper(model))) is model
    assert _chunks.unwrap(model) is model
    monkeypatch.delitem(sys.modules, "fake_wrappers")  # a class whose module is not imported
    assert isinstance(_chunks.unwrap(Wrapper(model)), Wrapper)


def test_helpers_import_nothing_heavy():
    code = (
        "import json, sys; from types import SimpleNamespace as S; "
        "import megatron_rl_patches.inference.chunks as c, megatron_rl_patches.ops.scoring_plan as a; "
        "m = S(config=1); assert c.unwrap(m) is m and c.as_chunks(m) == [m] and a.positive_int('n', 2) == 2; "
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules} & {'torch', 'megatron', 'numpy'})))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_bind_applies_defaults_or_returns_none():
    def helper(model_chunks, param_sync=True, *, flag=None):
        return None

    bound = calls.bind(helper, ([1],), {})
    assert dict(bound.arguments) == {"model_chunks": [1], "param_sync": True, "flag": None}
    assert calls.bind(helper, (), {"param_sync": False}) is None  # missing argument
    assert calls.bind(helper, (1, 2, 3), {}) is None  # too many
    assert calls.bind(max, (1, 2), {}) is None  # a builtin with no signature


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_positive_int_accepts_integers(value):
    assert scoring_plan.positive_int("n", value) == value


def test_positive_int_accepts_numpy_integers_as_int():
    np = pytest.importorskip("numpy")
    result = scoring_plan.positive_int("n", np.int64(3))
    assert result == 3 and type(result) is int


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "3", None])
def test_positive_int_rejects(value):
    with pytest.raises(ValueError, match=rf"^num_microbatches must be a positive int, got {re.escape(repr(value))}$"):
        scoring_plan.positive_int("num_microbatches", value)


def test_model_config_without_config_anywhere_is_none(monkeypatch):
    # without megatron.core.utils loaded, model_config walks `.module` itself
    monkeypatch.delitem(sys.modules, "megatron.core.utils", raising=False)
    fake = FakeDDP()
    fake.config = None  # `.module` is the chunk itself: the walk must end, not loop
    assert reentrant.model_config(fake) is None
    outer = SimpleNamespace(module=SimpleNamespace(module=SimpleNamespace(config="cfg")))
    assert reentrant.model_config(outer) == "cfg"
