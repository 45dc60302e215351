"""The default registry collects every integration's records from one table
(`integrations.RECORDS`): a record list left out of it, or a row naming nothing, fails here."""
from __future__ import annotations

import importlib
import pkgutil

from megatron_rl_patches import integrations
from megatron_rl_patches.patching.records import Patch


def record_lists() -> set[str]:
    """Every module-level tuple of Patch records in the integrations package, as a table row."""
    rows = set()
    for info in pkgutil.iter_modules(integrations.__path__):
        module = importlib.import_module(f"{integrations.__name__}.{info.name}")
        for attribute, value in vars(module).items():
            if isinstance(value, tuple) and value and all(isinstance(item, Patch) for item in value):
                rows.add(f"{info.name}:{attribute}")
    return rows


def test_every_record_list_is_in_the_table_once():
    assert sorted(integrations.RECORDS) == sorted(record_lists())
    assert len(set(integrations.RECORDS)) == len(integrations.RECORDS)


def test_the_registry_lists_patch_names_in_table_order():
    names = list(dict.fromkeys(patch.name for patch in integrations.all_patches()))
    # the first release's patches first, then the newer ones (new frameworks append rows)
    assert names[:6] == ["ddp_hooks", "train_reentry", "inference_roles", "slime_logprobs",
                         "gpt_output_processor", "grad_windows"]
    assert integrations.default_registry().patch_names() == names
