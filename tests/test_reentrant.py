"""Re-entrant train(): hook toggles, the sync-function guard and reentrant_train, on fake DDP."""
from __future__ import annotations

import inspect
import logging
import sys
import textwrap
import types

import pytest
import wrapt

import megatron_rl_patches
from megatron_rl_patches import reentrant
from megatron_rl_patches.integrations.megatron import core as megatron_core
from megatron_rl_patches.patching import registry
from megatron_rl_patches.reentrant import disable_hooks, enable_hooks, reentrant_train
from megatron_rl_patches.testing.fake_ddp import FakeDDP, fake_config

# A Megatron-style train() (the upstream assert, the install, hooks off at entry, on after
# step 0, off at exit) and its module-level helpers, as the real frameworks lay them out.
TRAIN_MODULE_SOURCE = textwrap.dedent(
    '''
    def enable_forward_pre_hook(model_chunks):
        for chunk in model_chunks:
            chunk.enable_forward_pre_hook()

    def disable_forward_pre_hook(model_chunks, param_sync=True):
        for chunk in model_chunks:
            chunk.disable_forward_pre_hook(param_sync=param_sync)

    def _own(model, name):
        methods = [getattr(chunk, name) for chunk in model]
        return methods[0] if len(methods) == 1 else methods

    def train_body(model, steps, fail_at):
        config = model[0].config
        assert config.no_sync_func is None, "a custom no_sync_func cannot be used with overlap_grad_reduce"
        config.no_sync_func = _own(model, "no_sync")
        config.grad_sync_func = _own(model, "start_grad_sync")
        config.param_sync_func = _own(model, "start_param_sync")
        disable_forward_pre_hook(model, param_sync=False)
        saved, config.param_sync_func = config.param_sync_func, None
        for step in range(steps):
            if step == fail_at:
                raise RuntimeError(f"injected failure at step {step}")
            if step == 0:
                enable_forward_pre_hook(model)
                config.param_sync_func = saved
        disable_forward_pre_hook(model)
        return {"steps": steps}

    def train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches=(),
              steps=2, fail_at=None):
        return train_body(model, steps, fail_at)
    '''
)
SLIME_MODEL = "slime.backends.megatron_utils.model"
MEGATRON_LM_TRAINING = "megatron.training.training"


def make_train_module(name: str = "fake_train_module", source: str = TRAIN_MODULE_SOURCE) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.fixture
def train_module() -> types.ModuleType:
    return make_train_module()


@pytest.fixture
def chunks(fake_ddp):
    """Two fake DDP chunks sharing one config, as virtual-pipeline chunks do."""
    config = fake_config()
    return [fake_ddp(config=config), fake_ddp(config=config)]


def sync_slots(config) -> tuple:
    return config.no_sync_func, config.grad_sync_func, config.param_sync_func


def rollout(train, model, rollout_id=0, **kwargs):
    return train(rollout_id, model, None, None, None, **kwargs)


# --- hook toggles ----------------------------------------------------------------------------

@pytest.mark.parametrize("param_sync", [True, False])
def test_second_disable_skips_the_hooks_but_honours_param_sync(fake_ddp, param_sync):
    ddp = fake_ddp()
    disable_hooks(ddp, param_sync=False)
    assert ddp.disable_forward_pre_hook.call_count == 1 and not ddp.hooks_enabled
    assert ddp.hook_removals == 3 and ddp.param_syncs == []

    disable_hooks(ddp, param_sync=param_sync)  # upstream raises KeyError here
    assert ddp.disable_forward_pre_hook.call_count == 1
    assert ddp.hook_removals == 3
    assert ddp.param_syncs == ([True] if param_sync else [])  # force_sync=True, as upstream's


def test_first_toggles_call_the_original_unchanged(fake_ddp):
    ddp = fake_ddp()
    disable_hooks(ddp)
    ddp.disable_forward_pre_hook.assert_called_once_with(param_sync=True)
    assert ddp.param_syncs == [True] and ddp.hook_removals == 3
    enable_hooks(ddp)
    ddp.enable_forward_pre_hook.assert_called_once_with()
    assert set(ddp.remove_forward_pre_hook_handles) == set(ddp.submodules)


def test_second_enable_is_a_no_op(fake_ddp):
    ddp = fake_ddp()
    before = dict(ddp.remove_forward_pre_hook_handles)
    enable_hooks(ddp)
    enable_hooks(ddp)
    assert ddp.enable_forward_pre_hook.call_count == 0  # spied after the constructor's registration
    assert ddp.remove_forward_pre_hook_handles == before and ddp.hook_removals == 0


def test_partial_hook_state_is_made_consistent(fake_ddp, caplog):
    ddp = fake_ddp()
    del ddp.remove_forward_pre_hook_handles[ddp.submodules[0]]  # a toggle interrupted half-way
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        disable_hooks(ddp)
    assert ddp.remove_forward_pre_hook_handles == {} and ddp.hook_removals == 2
    assert ddp.param_syncs == [True]
    assert "only some of its modules" in caplog.text

    ddp.remove_forward_pre_hook_handles[ddp.submodules[1]] = _StubHandle()
    enable_hooks(ddp)
    assert set(ddp.remove_forward_pre_hook_handles) == set(ddp.submodules)
    assert ddp.enable_forward_pre_hook.call_count == 1


class _StubHandle:
    def remove(self) -> None:
        pass


def test_chunks_without_forward_hooks_keep_upstreams_assert(fake_ddp):
    ddp = fake_ddp(use_forward_hook=False)
    with pytest.raises(AssertionError):
        enable_hooks(ddp)
    with pytest.raises(AssertionError):
        disable_hooks(ddp)


@pytest.mark.parametrize("toggle", [enable_hooks, disable_hooks])
def test_toggles_reject_a_non_ddp_object(toggle):
    with pytest.raises(TypeError, match="DistributedDataParallel model chunk.*got SimpleNamespace"):
        toggle(types.SimpleNamespace(config=None))


def test_method_wrappers_installed_on_a_class(monkeypatch):
    class PatchedDDP(FakeDDP):
        pass

    wrapt.wrap_function_wrapper(PatchedDDP, "enable_forward_pre_hook", megatron_core.enable_forward_pre_hook_wrapper)
    wrapt.wrap_function_wrapper(PatchedDDP, "disable_forward_pre_hook", megatron_core.disable_forward_pre_hook_wrapper)
    ddp = PatchedDDP()
    ddp.disable_forward_pre_hook(param_sync=False)
    ddp.disable_forward_pre_hook()  # no hooks: param sync only
    ddp.disable_forward_pre_hook(False)
    PatchedDDP.disable_forward_pre_hook(ddp, param_sync=True)  # called through the class
    assert ddp.param_syncs == [True, True] and ddp.hook_removals == 3
    ddp.enable_forward_pre_hook()
    handles = dict(ddp.remove_forward_pre_hook_handles)
    ddp.enable_forward_pre_hook()
    PatchedDDP.enable_forward_pre_hook(ddp)
    assert ddp.remove_forward_pre_hook_handles == handles
    with pytest.raises(TypeError):  # a call the original would reject is still rejected
        ddp.disable_forward_pre_hook(True, "extra")


# --- the sync-function guard -----------------------------------------------------------------

def test_unguarded_train_fails_on_rollout_two(train_module, fake_ddp):
    model = [fake_ddp()]
    rollout(train_module.train, model)
    with pytest.raises(AssertionError, match="no_sync_func"):
        rollout(train_module.train, model, 1)
    model[0].config.no_sync_func = None
    with pytest.raises(KeyError):
        rollout(train_module.train, model, 1)


@pytest.mark.parametrize("num_chunks", [1, 2])
def test_guarded_train_runs_every_rollout(train_module, fake_ddp, num_chunks):
    config = fake_config()
    model = [fake_ddp(config=config) for _ in range(num_chunks)]
    train = reentrant_train(train_module.train)
    for rollout_id in range(4):
        assert rollout(train, model, rollout_id) == {"steps": 2}
        own = [c.no_sync for c in model]
        assert config.no_sync_func == (own[0] if num_chunks == 1 else own)
        own_param_sync = [c.start_param_sync for c in model]
        assert config.param_sync_func == (own_param_sync[0] if num_chunks == 1 else own_param_sync)
        assert all(not c.hooks_enabled for c in model)
    # exit of every rollout: one forced param sync per chunk
    assert [c.param_syncs for c in model] == [[True] * 4] * num_chunks


def test_first_rollout_makes_the_same_calls_as_unguarded(train_module, fake_ddp):
    plain, guarded = fake_ddp(), fake_ddp()
    rollout(train_module.train, [plain])
    rollout(reentrant_train(train_module.train), [guarded])
    for name in ("enable_forward_pre_hook", "disable_forward_pre_hook", "start_param_sync"):
        assert getattr(plain, name).mock_calls == getattr(guarded, name).mock_calls, name
    assert plain.hook_removals == guarded.hook_removals


def _probe(model):
    """A train() that only reports the sync slots it finds at entry."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    return sync_slots(chunk.config)


@pytest.mark.parametrize(
    "make_value, cleared",
    [
        (lambda a, b, other: [a.no_sync, b.no_sync], True),
        (lambda a, b, other: (a.no_sync, b.no_sync), True),
        (lambda a, b, other: [b.no_sync, a.no_sync], False),  # wrong order
        (lambda a, b, other: a.no_sync, False),  # one method for two chunks
        (lambda a, b, other: [a.no_sync], False),  # too short
        (lambda a, b, other: [a.no_sync, other.no_sync], False),  # a stale chunk's method
        (lambda a, b, other: [a.no_sync, lambda: None], False),
    ],
)
def test_list_of_chunks_own_vs_foreign(chunks, fake_ddp, make_value, cleared, caplog):
    a, b = chunks
    value = make_value(a, b, fake_ddp())
    a.config.no_sync_func = value
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        seen = reentrant_train(_probe)(chunks)
    assert seen[0] is (None if cleared else value)
    assert ("config.no_sync_func holds" in caplog.text) is not cleared


def test_single_chunk_own_methods_are_cleared_single_or_as_one_item_list(fake_ddp):
    ddp = fake_ddp()
    ddp.config.no_sync_func = ddp.no_sync
    ddp.config.grad_sync_func = [ddp.start_grad_sync]
    ddp.config.param_sync_func = ddp.start_param_sync
    assert reentrant_train(_probe)(model=ddp) == (None, None, None)


def test_foreign_no_sync_func_is_left_for_upstreams_assert(train_module, fake_ddp, caplog):
    def custom_no_sync():
        pass

    ddp = fake_ddp()
    ddp.config.no_sync_func = custom_no_sync
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        with pytest.raises(AssertionError, match="no_sync_func"):
            rollout(reentrant_train(train_module.train), [ddp])
    assert ddp.config.no_sync_func is custom_no_sync
    assert ddp.hooks_enabled and ddp.disable_forward_pre_hook.call_count == 0
    message = caplog.text
    assert "config.no_sync_func holds" in message and "custom_no_sync" in message
    assert "assert config.no_sync_func is None" in message and "set config.no_sync_func = None" in message


@pytest.mark.parametrize(
    "slot, method", [("grad_sync_func", "start_grad_sync"), ("param_sync_func", "start_param_sync")]
)
def test_foreign_grad_and_param_sync_funcs_are_left_in_place(fake_ddp, slot, method, caplog):
    ddp = fake_ddp()
    foreign = getattr(fake_ddp(), method)
    setattr(ddp.config, slot, foreign)
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        seen = dict(zip(("no_sync_func", "grad_sync_func", "param_sync_func"), reentrant_train(_probe)([ddp])))
    assert seen[slot] is foreign
    assert f"config.{slot} holds" in caplog.text and f"own `{method}`" in caplog.text


def test_config_without_sync_slots_is_tolerated(fake_ddp):
    ddp = fake_ddp(config=types.SimpleNamespace())
    assert reentrant_train(lambda model: "ran")([ddp]) == "ran"


def test_config_found_through_wrapped_modules(fake_ddp):
    ddp = fake_ddp()
    inner = types.SimpleNamespace(config=ddp.config)
    outer = types.SimpleNamespace(config=None, module=inner)
    assert reentrant.model_config(outer) is ddp.config
    assert reentrant.model_config(types.SimpleNamespace()) is None


# --- restoring state when train() raises --------------------------------------------------------

@pytest.mark.parametrize("fail_at", [0, 1])
def test_exception_mid_rollout_restores_config_and_hooks(train_module, chunks, fail_at):
    train = reentrant_train(train_module.train)
    rollout(train, chunks, 0)
    config = chunks[0].config
    entry_slots = sync_slots(config)
    syncs_before = [list(c.param_syncs) for c in chunks]

    with pytest.raises(RuntimeError, match=f"injected failure at step {fail_at}"):
        rollout(train, chunks, 1, fail_at=fail_at)
    assert all(now is was for now, was in zip(sync_slots(config), entry_slots))
    assert all(not c.hooks_enabled for c in chunks)  # disabled at entry, so disabled again
    assert [c.param_syncs for c in chunks] == syncs_before  # no collective while restoring

    assert rollout(train, chunks, 2) == {"steps": 2}


def test_exception_restores_hooks_that_were_enabled_at_entry(train_module, chunks):
    with pytest.raises(RuntimeError):
        rollout(reentrant_train(train_module.train), chunks, fail_at=0)
    assert all(c.hooks_enabled for c in chunks)
    assert sync_slots(chunks[0].config) == (None, None, None)


def test_exception_is_reraised_unchanged_even_if_restoring_fails(fake_ddp, monkeypatch, caplog):
    error = ValueError("from train")

    def train(model):
        raise error

    def broken_restore(entry):
        raise RuntimeError("restore failed")

    monkeypatch.setattr(reentrant, "_restore", broken_restore)
    with caplog.at_level(logging.ERROR, logger="megatron_rl_patches"):
        with pytest.raises(ValueError) as excinfo:
            reentrant_train(train)([fake_ddp()])
    assert excinfo.value is error
    assert "could not restore state" in caplog.text


# --- reentrant_train: signature, chunk discovery, double wrapping --------------------------------

def test_signature_name_doc_and_return_value_preserved(fake_ddp):
    result = object()

    def my_train(rollout_id: int, model: list, *, lr: float = 0.1) -> object:
        """My docstring."""
        return result

    wrapped = reentrant_train(my_train)
    assert inspect.signature(wrapped) == inspect.signature(my_train)
    assert wrapped.__name__ == "my_train" and wrapped.__doc__ == "My docstring."
    assert wrapped.__wrapped__ is my_train
    assert wrapped(0, [fake_ddp()], lr=0.5) is result


def test_applying_twice_wraps_once_and_nested_guards_do_the_work_once(train_module, fake_ddp, mocker):
    once = reentrant_train(train_module.train)
    assert reentrant_train(once) is once
    enter = mocker.spy(reentrant, "_enter")
    outer = reentrant_train(lambda model: rollout(once, model))
    model = [fake_ddp()]
    for _rollout_id in range(3):
        outer(model)
    assert enter.call_count == 3


@pytest.mark.parametrize(
    "call",
    [
        lambda f, m: f(0, m),
        lambda f, m: f(rollout_id=0, model=m),
    ],
)
def test_chunks_found_by_parameter_name_model(call, fake_ddp):
    def train(rollout_id, model):
        return sync_slots(model[0].config)

    model = [fake_ddp()]
    model[0].config.no_sync_func = model[0].no_sync
    assert call(reentrant_train(train), model)[0] is None


def test_chunks_found_by_parameter_name_model_chunks_and_single_module(fake_ddp):
    ddp = fake_ddp()
    ddp.config.no_sync_func = ddp.no_sync

    def train(model_chunks):
        return model_chunks.config.no_sync_func

    assert reentrant_train(train)(ddp) is None


@pytest.mark.parametrize("as_sequence", [list, tuple, None])
def test_chunks_found_as_first_ddp_argument(fake_ddp, as_sequence):
    ddp = fake_ddp()
    ddp.config.no_sync_func = ddp.no_sync
    argument = ddp if as_sequence is None else as_sequence([ddp])

    def train(step, nets, extra=None):
        return ddp.config.no_sync_func

    assert reentrant_train(train)(3, argument, extra=[object()]) is None


def test_no_chunks_is_a_clear_error_and_nothing_runs(mocker):
    body = mocker.Mock()

    def train(rollout_id, state):
        body()

    expected = r"cannot find the model chunks in the call to .*train.*'model' or 'model_chunks'.*\(int, list\)"
    with pytest.raises(TypeError, match=expected):
        reentrant_train(train)(0, [1, 2])
    body.assert_not_called()


def test_a_call_that_does_not_bind_raises_the_functions_own_error(fake_ddp):
    def train(rollout_id, model):
        raise AssertionError("never reached")

    with pytest.raises(TypeError, match="missing a required argument|missing 1 required positional"):
        reentrant_train(train)(0)


def test_reentrant_train_rejects_a_non_callable():
    with pytest.raises(TypeError, match="expected a callable train function, got int"):
        reentrant_train(3)


def test_inference_only_chunks_are_refused_and_nothing_changes(chunks, mocker):
    chunks[1]._mrp_inference_only = True
    config = chunks[0].config
    config.no_sync_func = [c.no_sync for c in chunks]
    before = sync_slots(config)
    body = mocker.Mock()
    expected = "model chunk 1 .*built inference-only.*MEGATRON_RL_PATCHES_INFERENCE_ROLES"
    with pytest.raises(TypeError, match=expected):
        reentrant_train(lambda model: body())(chunks)
    body.assert_not_called()
    assert sync_slots(config) == before


def test_inference_only_mark_is_found_on_a_wrapped_module(fake_ddp):
    frozen = types.SimpleNamespace(module=types.SimpleNamespace(_mrp_inference_only=True))
    with pytest.raises(TypeError, match="model chunk 1 \\(SimpleNamespace\\): it was built inference-only"):
        reentrant_train(lambda model: None)([fake_ddp(), frozen])


def test_public_name_is_exported_lazily():
    assert megatron_rl_patches.reentrant_train is reentrant_train


# --- the registry records (patch train_reentry) -------------------------------------------------

def test_train_reentry_wraps_slime_train_and_helpers(monkeypatch, fake_ddp):
    module = make_train_module(SLIME_MODEL)
    monkeypatch.setitem(sys.modules, SLIME_MODEL, module)
    original_train = module.train
    statuses = megatron_rl_patches.apply(only="train_reentry")
    by_target = {s.target: s.status for s in statuses}
    for name in ("train", "enable_forward_pre_hook", "disable_forward_pre_hook"):
        assert by_target[f"{SLIME_MODEL}:{name}"] == "applied"
        assert isinstance(getattr(module, name), wrapt.FunctionWrapper)

    config = fake_config()
    model = [fake_ddp(config=config), fake_ddp(config=config)]
    for rollout_id in range(3):
        assert rollout(module.train, model, rollout_id) == {"steps": 2}
    # the helpers alone are idempotent, and skip inference-only chunks
    frozen = types.SimpleNamespace(_mrp_inference_only=True)
    module.disable_forward_pre_hook([*model, frozen], param_sync=False)
    module.enable_forward_pre_hook([*model, frozen])
    module.enable_forward_pre_hook(model)
    assert all(c.hooks_enabled for c in model)

    megatron_rl_patches.revert()
    assert module.train is original_train
    with pytest.raises(AssertionError, match="no_sync_func"):
        rollout(module.train, model, 3)


def test_train_reentry_helpers_leave_unknown_chunks_to_the_original(monkeypatch):
    module = make_train_module(SLIME_MODEL)
    monkeypatch.setitem(sys.modules, SLIME_MODEL, module)
    megatron_rl_patches.apply(only="train_reentry")
    with pytest.raises(AttributeError, match="enable_forward_pre_hook"):
        module.enable_forward_pre_hook([object()])


def test_train_reentry_wraps_megatron_lm_train(monkeypatch, fake_ddp):
    source = TRAIN_MODULE_SOURCE + textwrap.dedent(
        '''
        def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
                  valid_data_iterator, process_non_loss_data_func, config, checkpointing_context,
                  non_loss_data_func):
            return train_body(model, 2, None)
        '''
    )
    module = make_train_module(MEGATRON_LM_TRAINING, source)
    monkeypatch.setitem(sys.modules, MEGATRON_LM_TRAINING, module)
    statuses = {s.target: s.status for s in megatron_rl_patches.apply(only="train_reentry")}
    assert statuses[f"{MEGATRON_LM_TRAINING}:train"] == "applied"
    model = [fake_ddp()]
    for _ in range(3):
        assert module.train(None, model, None, None, None, None, None, model[0].config, None, None) == {"steps": 2}


def test_train_with_another_signature_is_skipped_with_the_reason(monkeypatch):
    module = make_train_module(SLIME_MODEL, TRAIN_MODULE_SOURCE + "\ndef train(args, role):\n    pass\n")
    monkeypatch.setitem(sys.modules, SLIME_MODEL, module)
    statuses = {s.target: s for s in megatron_rl_patches.apply(only="train_reentry")}
    status = statuses[f"{SLIME_MODEL}:train"]
    assert status.status == "skipped" and "has parameters (args, role)" in status.reason
    assert statuses[f"{SLIME_MODEL}:enable_forward_pre_hook"].status == "applied"

    megatron_rl_patches.revert()
    with pytest.raises(registry.PatchSignatureMismatch, match=f"{SLIME_MODEL}:train"):
        megatron_rl_patches.apply(only="train_reentry", strict=True)


def test_missing_train_is_skipped_with_the_reason(monkeypatch):
    module = make_train_module(SLIME_MODEL)
    del module.train
    monkeypatch.setitem(sys.modules, SLIME_MODEL, module)
    statuses = {s.target: s for s in megatron_rl_patches.apply(only="train_reentry")}
    assert statuses[f"{SLIME_MODEL}:train"].status == "skipped"
    assert "not found" in statuses[f"{SLIME_MODEL}:train"].reason


@pytest.mark.megatron
def test_guard_stops_megatron_lms_running_interval_timer(megatron_cpu, monkeypatch):
    """Megatron-LM's train() leaves its global 'interval-time' timer running; a second train()
    then asserts 'timer has already been started'. The guard stops it on entry (megatron-core's
    real Timers, installed where Megatron-LM keeps them)."""
    import types

    from megatron.core.timers import Timers

    timers = Timers(log_level=0, log_option="minmax")
    timers("interval-time", log_level=0).start(barrier=False)
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_TIMERS = timers
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    with pytest.raises(AssertionError, match="timer has already been started"):
        timers("interval-time", log_level=0).start(barrier=False)  # what the second train() hit
    reentrant.stop_interval_timer()
    timers("interval-time", log_level=0).start(barrier=False)  # a second call can start it again
    reentrant.stop_interval_timer()
    reentrant.stop_interval_timer()  # idempotent; and a no-op without Megatron-LM's timers:
    monkeypatch.delitem(sys.modules, "megatron.training.global_vars")
    reentrant.stop_interval_timer()
