"""The `model/` room's chunk, kind and argument helpers (`model.chunks`, `model.kinds`, `model.arguments`) and
`ops.scoring_plan`'s `positive_int`, which reentrant, the wrappers, inference and the integrations use."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_rl_patches import reentrant
from megatron_rl_patches.model import arguments as calls
from megatron_rl_patches.model import chunks as _chunks
from megatron_rl_patches.model import kinds
from megatron_rl_patches.ops import scoring_plan
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


def language_model(**fields):
    """A stand-in that `kinds.is_language_model` reads as GPTModel (decoder, stage flags, vocabulary)."""
    return SimpleNamespace(**{"decoder": object(), "pre_process": True, "post_process": True, "vocab_size": 8,
                              **fields})


class Wrapper:
    def __init__(self, module):
        self.module = module


def test_unwrap_finds_the_language_model_under_any_wrapper():
    """The one `unwrap` (issue 113): the language model under a framework's own wrapper too (the
    inference helper stopped at a wrapper class it did not know), at the model even where it holds a
    `.module` of its own (the slime helper went on), and a `.module` chain with a cycle ends."""
    gpt = language_model()
    assert _chunks.unwrap(Wrapper(Wrapper(gpt))) is gpt
    assert _chunks.unwrap(gpt) is gpt
    inner = SimpleNamespace()
    assert _chunks.unwrap(language_model(module=inner)) is not inner  # stops at the model
    looped = Wrapper(None)
    looped.module = looped
    assert _chunks.unwrap(looped) is looped
    assert _chunks.unwrap(Wrapper(None)).module is None and _chunks.unwrap(None) is None
    assert _chunks.unwrap(Wrapper(Wrapper(inner))) is inner  # no language model: the innermost link
    assert _chunks.is_last_stage(Wrapper(gpt))
    assert not _chunks.is_last_stage(Wrapper(language_model(post_process=False)))


def test_kinds_read_what_a_module_holds():
    assert kinds.is_language_model(language_model())
    assert not kinds.is_language_model(SimpleNamespace(decoder=object(), vocab_size=8))
    assert kinds.is_attention(SimpleNamespace(core_attention=object(), linear_proj=object()))
    assert not kinds.is_attention(SimpleNamespace(core_attention=object()))


def test_modules_of_walks_every_chunk_and_names_the_caller():
    torch = pytest.importorskip("torch")
    first, second = torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU())
    found = list(_chunks.modules_of([first, second], "who"))
    assert found == [first, second, second[0]]
    assert list(_chunks.modules_of(first, "who")) == [first]
    with pytest.raises(TypeError, match=r"^prepare: expected megatron-core model chunks, got str$"):
        list(_chunks.modules_of([first, "x"], "prepare"))


def test_arguments_by_name_read_and_replace_positional_and_keyword_arguments():
    class Layer:
        def forward(self, hidden, mask=None, *, params=None):
            return None

    call = calls.ArgumentsByName.of_forward(Layer(), (1,), {"mask": 2, "extra": 3})
    assert (call.get("hidden"), call.get("mask"), call.get("params"), call.get("extra")) == (1, 2, None, 3)
    call.set("hidden", 10)
    call.set("mask", 20)
    call.set("params", 30)
    assert call.done() == ((10,), {"mask": 20, "extra": 3, "params": 30})
    free = calls.ArgumentsByName(lambda a, b: None, (1, 2), {})
    free.set("b", 5)
    assert free.done() == ((1, 5), {})


def test_helpers_import_nothing_heavy():
    code = (
        "import json, sys; from types import SimpleNamespace as S; "
        "import megatron_rl_patches.model.chunks as c, megatron_rl_patches.ops.scoring_plan as a; "
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
