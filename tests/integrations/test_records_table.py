"""The default registry collects every framework's records from one place per framework
(`integrations/<framework>/patches.py`, named in `integrations.FRAMEWORKS`) and lists them in
`integrations.ORDER`: a record tuple declared anywhere else, a framework package left out, or a
patch name missing from ORDER fails here."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

from megatron_rl_patches import integrations
from megatron_rl_patches.patching.records import Patch


def record_tuples() -> set[str]:
    """Every module-level tuple of Patch records below the integrations package, as module:attribute."""
    rows = set()
    for info in pkgutil.walk_packages(integrations.__path__, prefix=f"{integrations.__name__}."):
        module = importlib.import_module(info.name)
        for attribute, value in vars(module).items():
            if isinstance(value, tuple) and value and all(isinstance(item, Patch) for item in value):
                rows.add(f"{info.name.removeprefix(integrations.__name__ + '.')}:{attribute}")
    return rows


def test_each_framework_declares_its_records_in_one_place():
    assert record_tuples() == {f"{framework}.patches:PATCHES" for framework in integrations.FRAMEWORKS}
    packages = {info.name for info in pkgutil.iter_modules(integrations.__path__) if info.ispkg}
    assert packages == set(integrations.FRAMEWORKS) | set(integrations.SHARED_BY_FRAMEWORKS)


def test_the_registry_lists_patch_names_in_the_explicit_order():
    names = list(dict.fromkeys(patch.name for patch in integrations.all_patches()))
    assert names == list(integrations.ORDER)  # every name listed, none stale
    # the first release's patches first, then the newer ones
    assert names[:6] == ["ddp_hooks", "train_reentry", "inference_roles", "slime_logprobs",
                         "gpt_output_processor", "grad_windows"]
    assert integrations.default_registry().patch_names() == names


def test_a_patch_name_missing_from_the_order_is_refused(monkeypatch):
    monkeypatch.setattr(integrations, "ORDER", tuple(n for n in integrations.ORDER if n != "slime_opd"))
    with pytest.raises(RuntimeError, match=r"\['slime_opd'\] are not in .*ORDER"):
        integrations.all_patches()


def test_records_of_one_name_keep_their_framework_order():
    records = integrations.all_patches()
    train = [p.module for p in records if p.name == "train_reentry"]
    assert train[:3] == ["megatron.training.training"] * 3 and train[3:] == ["slime.backends.megatron_utils.model"] * 3
