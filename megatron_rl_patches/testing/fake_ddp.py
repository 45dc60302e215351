"""A stand-in for megatron-core's DistributedDataParallel hook / sync API, for fast unit tests.

It mirrors the upstream behaviour that matters to RL loops: hooks registered at construction
when `use_forward_hook`, `disable_forward_pre_hook` raising KeyError when called twice,
`enable_forward_pre_hook` asserting when hooks exist. No torch needed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any


class _Handle:
    def __init__(self, owner: FakeDDP) -> None:
        self.owner = owner

    def remove(self) -> None:
        self.owner.hook_removals += 1


class FakeDDP:
    """Duck-typed like megatron.core.distributed.DistributedDataParallel (hook and sync methods)."""

    def __init__(self, config: Any = None, use_forward_hook: bool = True, num_modules: int = 3) -> None:
        self.config = config if config is not None else fake_config()
        self.use_forward_hook = use_forward_hook
        self.submodules = [object() for _ in range(num_modules)]
        self.remove_forward_pre_hook_handles: dict[Any, _Handle] = {}
        self.hook_removals = 0
        self.param_syncs: list[bool] = []  # force_sync of each start_param_sync call
        self.grad_syncs = 0
        self.in_no_sync = False
        if use_forward_hook:
            self.enable_forward_pre_hook()

    def modules(self) -> Iterator[Any]:
        return iter(self.submodules)

    @property
    def module(self) -> FakeDDP:
        return self

    def enable_forward_pre_hook(self) -> None:
        assert self.use_forward_hook
        assert len(self.remove_forward_pre_hook_handles) == 0
        for module in self.module.modules():
            self.remove_forward_pre_hook_handles[module] = _Handle(self)

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        assert self.use_forward_hook
        for module in self.module.modules():
            self.remove_forward_pre_hook_handles[module].remove()  # KeyError when already disabled
            del self.remove_forward_pre_hook_handles[module]
        if param_sync:
            self.start_param_sync(force_sync=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False

    def start_grad_sync(self, *unused: Any) -> None:
        self.grad_syncs += 1

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        self.param_syncs.append(force_sync)

    def finish_grad_sync(self) -> None:
        pass

    @property
    def hooks_enabled(self) -> bool:
        return bool(self.remove_forward_pre_hook_handles)


def fake_config(**values: Any) -> SimpleNamespace:
    """A config carrying the sync-function slots train() installs."""
    base = {"no_sync_func": None, "grad_sync_func": None, "param_sync_func": None}
    base.update(values)
    return SimpleNamespace(**base)
