"""The registry in one process, on stand-in modules: statuses, idempotency, exact revert, captured
references, method targets, failures, warnings once."""
from __future__ import annotations

import importlib
import json
import logging
import sys
import types

import pytest
import wrapt

from megatron_rl_patches.patching import registry
from megatron_rl_patches.patching.registry import Patch, Registry
from megatron_rl_patches.patching.wrappers import patch_key


class _Current:
    """The registry the running test built with the `catalog` fixture (stand-in records)."""

    registry: Registry | None = None

    def __getattr__(self, name):
        return getattr(type(self).registry, name)


reg = _Current()

MODULE_SOURCE = '''
class Engine:
    def step(self, n):
        return ("original", self.tag, n)

    tag = "engine"


def train(rollout_id, model, optimizer):
    return ("original", rollout_id)


def helper(model_chunks):
    return ("original", model_chunks)
'''

_counter = iter(range(10**6))


class Spy:
    """A wrapt-style wrapper that records calls and answers without calling the original."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, wrapped, instance, args, kwargs):
        self.calls.append((instance, args, kwargs))
        return ("spy", wrapped(*args, **kwargs))


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A fresh importable stand-in module (unique name), removed from sys.modules afterwards."""
    name = f"standin_mod_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def catalog(monkeypatch):
    """Replace the registry's catalog with the given records for one test."""
    for var in ("MEGATRON_RL_PATCHES", "MEGATRON_RL_PATCHES_DISABLE", "MEGATRON_RL_PATCHES_STRICT"):
        monkeypatch.delenv(var, raising=False)

    def use(*patches: Patch) -> Registry:
        _Current.registry = Registry(patches)
        return _Current.registry

    yield use
    if _Current.registry is not None:
        _Current.registry.reset()
    _Current.registry = None


def our_layers(obj) -> int:
    return sum(patch_key(entry) is not None for entry in wrapt.wrapper_chain(obj))


def statuses() -> dict[str, tuple[str, str]]:
    return {s.target: (s.status, s.reason) for s in reg.applied()}


def test_pending_until_import_then_applied(standin, catalog):
    spy = Spy()
    catalog(Patch("train_reentry", f"{standin}:train", spy, "d", requires=None))
    result = reg.apply()
    assert [(s.name, s.status) for s in result] == [("train_reentry", "pending")]
    assert standin in statuses()[f"{standin}:train"][1]  # "waiting for the import of <module>"
    module = importlib.import_module(standin)  # the post-import hook lands the patch
    assert statuses()[f"{standin}:train"] == ("applied", "")
    assert module.train(7, None, None) == ("spy", ("original", 7))
    assert spy.calls == [(None, (7, None, None), {})]


def test_apply_n_times_is_one_layer_and_revert_is_exact(standin, catalog):
    module = importlib.import_module(standin)
    original = module.train
    catalog(Patch("train_reentry", f"{standin}:train", Spy(), "d", requires=None))
    for _ in range(4):
        reg.apply()
    assert our_layers(module.train) == 1 and module.train.__wrapped__ is original
    for _ in range(3):
        reg.revert()
    assert vars(module)["train"] is original
    assert statuses()[f"{standin}:train"] == ("skipped", "reverted")
    reg.apply()
    reg.apply(only="train_reentry")
    assert our_layers(module.train) == 1 and module.train.__wrapped__ is original


def test_a_name_bound_from_another_target_of_the_same_patch_is_not_wrapped_twice(standin, catalog, tmp_path):
    """slime's loss module binds ppo_utils' function at import: patched first, it must keep one layer."""
    alias = f"{standin}_alias"
    (tmp_path / f"{alias}.py").write_text(f"from {standin} import train\n")
    spy = Spy()
    catalog(Patch("train_reentry", f"{standin}:train", spy, "d", requires=None),
            Patch("train_reentry", f"{alias}:train", spy, "d", requires=None))
    reg.apply()
    try:
        module = importlib.import_module(alias)  # imports the source first (patched there), then binds
        assert module.train is sys.modules[standin].train and our_layers(module.train) == 1
        assert statuses()[f"{alias}:train"] == ("applied", f"already wrapped (bound from {standin}:train)")
        assert module.train(3, None, None) == ("spy", ("original", 3))
        reg.revert()
        assert module.train(3, None, None) == ("original", 3)
        reg.apply()
        assert our_layers(module.train) == 1 and module.train(3, None, None)[0] == "spy"
    finally:
        sys.modules.pop(alias, None)


def test_reference_captured_while_patched_follows_the_state(standin, catalog):
    spy = Spy()
    catalog(Patch("train_reentry", f"{standin}:train", spy, "d", requires=None))
    reg.apply()
    module = importlib.import_module(standin)
    captured = module.train  # like `from standin import train` while patched
    assert captured(1, None, None)[0] == "spy"
    reg.revert()
    assert captured(2, None, None) == ("original", 2)
    assert module.train(3, None, None) == ("original", 3)
    assert len(spy.calls) == 1
    reg.apply()  # re-applied: a fresh wrapper, the captured one active again, no double layer
    assert captured(4, None, None)[0] == "spy" and module.train(5, None, None)[0] == "spy"
    assert our_layers(module.train) == 1 and our_layers(captured) == 1


def test_method_target_gets_instance_and_reverts_to_the_class_dict_entry(standin, catalog):
    module = importlib.import_module(standin)
    original = vars(module.Engine)["step"]
    spy = Spy()
    catalog(Patch("ddp_hooks", f"{standin}:Engine.step", spy, "d", requires=None, params=("self", "n")))
    reg.apply()
    engine = module.Engine()
    assert engine.step(3) == ("spy", ("original", "engine", 3))
    assert spy.calls[0][0] is engine and spy.calls[0][1] == (3,)
    reg.revert()
    assert vars(module.Engine)["step"] is original
    assert engine.step(4) == ("original", "engine", 4)


def test_revert_only_named_patches(standin, catalog):
    module = importlib.import_module(standin)
    catalog(
        Patch("train_reentry", f"{standin}:train", Spy(), "d", requires=None),
        Patch("ddp_hooks", f"{standin}:helper", Spy(), "d", requires=None),
    )
    reg.apply()
    result = reg.revert(only="ddp_hooks")
    assert [(s.name, s.status) for s in result] == [("ddp_hooks", "skipped")]
    assert our_layers(module.train) == 1 and our_layers(module.helper) == 0
    with pytest.raises(ValueError, match="valid names: train_reentry, ddp_hooks"):
        reg.revert(only="nope")
    assert our_layers(module.train) == 1


def test_statuses_cover_every_record_and_serialize(standin, catalog):
    catalog(
        Patch("train_reentry", f"{standin}:train", Spy(), "d", requires=None),
        Patch("train_reentry", f"{standin}:helper", Spy(), "d", requires=None),
        Patch("ddp_hooks", f"{standin}:Engine.step", Spy(), "d", requires=None),
    )
    assert {s.status for s in reg.applied()} == {"skipped"}
    assert all((s.reason, s.code) == ("not selected", registry.NOT_SELECTED) for s in reg.applied())
    reg.apply(exclude="ddp_hooks")
    importlib.import_module(standin)
    found = reg.applied()
    assert [(s.name, s.status) for s in found] == [
        ("train_reentry", "applied"),
        ("train_reentry", "applied"),
        ("ddp_hooks", "skipped"),
    ]
    assert (found[2].reason, found[2].code) == ("disabled by exclude=", registry.DISABLED)
    payload = json.loads(json.dumps([s.as_dict() for s in found]))
    assert payload[0] == {
        "name": "train_reentry", "target": f"{standin}:train", "status": "applied", "reason": "", "code": "ok"
    }
    assert [(p.target, s.status) for p, s in reg.entries()] == [(s.target, s.status) for s in found]


def test_unresolvable_wrapper_is_failed_and_strict_raises(standin, catalog):
    importlib.import_module(standin)
    catalog(Patch("train_reentry", f"{standin}:train", "megatron_rl_patches.no_such:wrapper", "d", requires=None))
    reg.apply()
    status, reason = statuses()[f"{standin}:train"]
    assert status == "failed" and "ModuleNotFoundError" in reason
    with pytest.raises(registry.PatchError, match=f"'train_reentry' failed on {standin}:train"):
        reg.apply(strict=True)


def test_strict_failure_at_import_makes_the_import_fail(standin, catalog):
    catalog(Patch("train_reentry", f"{standin}:no_such_attr", Spy(), "d", requires=None))
    reg.apply(strict=True)
    with pytest.raises(registry.PatchTargetMissing, match=f"{standin}:no_such_attr"):
        importlib.import_module(standin)
    assert standin not in sys.modules


def test_same_problem_on_two_targets_warns_once(standin, catalog, caplog):
    importlib.import_module(standin)
    catalog(
        Patch("ddp_hooks", f"{standin}:train", Spy(), "d", requires="packaging", versions="<1"),
        Patch("ddp_hooks", f"{standin}:helper", Spy(), "d", requires="packaging", versions="<1"),
    )
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        reg.apply()
        reg.apply()
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl_patches"]
    assert len(lines) == 1 and "outside the supported range '<1'" in lines[0]
    assert {s.status for s in reg.applied()} == {"skipped"}


@pytest.mark.parametrize("linked", [True, False])
def test_revert_under_a_foreign_wrapper_or_a_replacement(standin, catalog, linked):
    """A plain closure put over ours (linked by __wrapped__: wrapt cannot splice it out) leaves ours
    inert beneath it; an attribute replaced wholesale (no link: wrapt finds nothing of ours) stays."""
    module = importlib.import_module(standin)
    spy = Spy()
    catalog(Patch("train_reentry", f"{standin}:train", spy, "d", requires=None))
    reg.apply()
    patched = module.train

    def foreign(*args, **kwargs):
        return ("foreign", patched(*args, **kwargs))

    if linked:
        foreign.__wrapped__ = patched
    module.train = foreign
    (result,) = reg.revert()
    assert result.status == "skipped"
    assert ("inert" in result.reason) if linked else (result.reason == "reverted")
    assert module.train is foreign and module.train(1, None, None) == ("foreign", ("original", 1))
    assert spy.calls == []


def test_already_imported_target_lands_immediately(standin, catalog):
    module = importlib.import_module(standin)
    catalog(Patch("train_reentry", f"{standin}:train", Spy(), "d", requires=None))
    assert [s.status for s in reg.apply()] == ["applied"]
    assert module.train(0, None, None)[0] == "spy"


def test_apply_from_inside_the_target_modules_own_import_lands_afterwards(tmp_path, monkeypatch, catalog):
    """apply() while the target module is still executing must not give up on its patches."""
    name = f"standin_mod_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(
        "import mrp_test_registry\nmrp_test_registry.registry.apply()\n" + MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    spy = Spy()
    holder = types.ModuleType("mrp_test_registry")  # how the module reaches this test's registry
    holder.registry = catalog(Patch("train_reentry", f"{name}:train", spy, "d", requires=None))
    monkeypatch.setitem(sys.modules, "mrp_test_registry", holder)
    try:
        module = importlib.import_module(name)
        assert statuses()[f"{name}:train"][0] == "applied"  # applied() retries once the import is done
        assert module.train(1, None, None) == ("spy", ("original", 1))
    finally:
        sys.modules.pop(name, None)


def test_a_missing_optional_alias_is_skipped_quietly_even_in_strict_mode(standin, catalog, caplog):
    catalog(Patch("train_reentry", f"{standin}:no_alias_here", Spy(), "d", requires=None, optional=True))
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        reg.apply(strict=True)
        importlib.import_module(standin)
    status, reason = statuses()[f"{standin}:no_alias_here"]
    assert status == "skipped" and "optional" in reason
    assert not caplog.records


def test_apply_rejects_arguments_of_the_wrong_type(catalog):
    catalog()
    with pytest.raises(TypeError, match="strict"):
        reg.apply(strict="no")
    with pytest.raises(TypeError, match="patch names"):
        reg.apply(only=123)


def test_a_target_lookup_that_raises_is_a_failed_status_not_a_broken_import(tmp_path, monkeypatch, catalog):
    """A module-level __getattr__ raising something other than AttributeError is no missing target
    (wrapt's PathResolutionError): the record fails, the import goes on; strict raises."""
    name = f"standin_mod_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text("def __getattr__(name):\n    raise RuntimeError(f'lazy {name} broke')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    catalog(Patch("train_reentry", f"{name}:train", Spy(), "d", requires=None))
    try:
        reg.apply()
        importlib.import_module(name)
        status, reason = statuses()[f"{name}:train"]
        assert status == "failed" and reason == "RuntimeError: lazy train broke"
        reg.reset()
        with pytest.raises(registry.PatchError, match="'train_reentry' failed on") as caught:
            reg.apply(strict=True)  # the module is imported: installed (and raised) at once
        assert isinstance(caught.value.__cause__, RuntimeError)
    finally:
        sys.modules.pop(name, None)
