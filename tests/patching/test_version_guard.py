"""Version guards (PEP 440, never string comparison), missing targets and changed signatures:
skipped with a reason and one warning, or a named error in strict mode."""
from __future__ import annotations

import importlib
import logging
import sys

import pytest

from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.patching import registry
from megatron_rl_patches.patching.registry import Patch, Registry

REG = default_registry()  # the real catalog

MCORE_RANGE = ">=0.13,<0.21"

SLIME_MODULE = "slime.backends.megatron_utils.model"


@pytest.fixture
def clean(clean_patch_state):
    return clean_patch_state


@pytest.fixture
def fake_slime(tmp_path, clean, slime_standin_writer, slime_standin_source):
    """Writes a copy of the stand-in slime package; call with the model module's source (a variant
    of the stand-in's); imports it. slime modules imported by other tests are set aside and put
    back afterwards."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "slime"}

    def make(source: str = slime_standin_source):
        slime_standin_writer(tmp_path, source)
        clean.syspath_prepend(str(tmp_path))
        return importlib.import_module(SLIME_MODULE)

    yield make
    for name in [m for m in sys.modules if m.split(".")[0] == "slime"]:
        del sys.modules[name]
    sys.modules.update(saved)


def fake_version(monkeypatch, version: str | None, distribution: str = "megatron-core") -> None:
    """Pretend `distribution` has `version`, for plain records and for the megatron records'
    version finder (which reads the code in use, also from a source checkout)."""
    from megatron_rl_patches.integrations.megatron import version as megatron_version

    real = registry.installed_version
    monkeypatch.setattr(registry, "installed_version", lambda d: version if d == distribution else real(d))
    if distribution == "megatron-core":
        monkeypatch.setattr(megatron_version, "installed_version", lambda: version)


def one_record(versions: str) -> Patch:
    """A record on json.dumps guarded by the megatron-core version (a stand-in target)."""
    return Patch("ddp_hooks", "json:dumps", lambda w, i, a, k: "spy", "d", requires="megatron-core", versions=versions)


@pytest.mark.parametrize(
    ("installed", "fits"),
    [
        ("0.13.0", True),
        ("0.13.1", True),
        ("0.16.1", True),
        ("0.16.1+local.build", True),
        ("0.16.0rc2", True),
        ("0.9.0", False),  # "0.9.0" > "0.13" as strings: string comparison would let it in
        ("0.12.99", False),
        ("0.19.2", True),
        ("0.20.0rc0", True),  # main's development builds
        ("0.20.0.dev0", True),
        ("0.21.0rc1", False),  # a pre-release of the excluded bound stays excluded
        ("0.21.0", False),
        ("0.100.0", False),  # "0.100.0" < "0.21" as strings
    ],
)
def test_range_uses_pep440(clean, installed, fits):
    patch = one_record(MCORE_RANGE)
    fake_version(clean, installed)
    problem = registry.version_problem(patch)
    assert (problem is None) is fits
    if not fits:
        assert installed in problem and MCORE_RANGE in problem and "'ddp_hooks'" in problem


def test_unknown_distribution_or_garbage_version(clean):
    patch = one_record(MCORE_RANGE)
    fake_version(clean, None)  # a source checkout with no metadata: the signature check guards
    assert registry.version_problem(patch) is None
    fake_version(clean, "not a version")
    assert "cannot compare megatron-core version 'not a version'" in registry.version_problem(patch)


@pytest.mark.megatron
def test_real_ddp_target_skipped_for_old_megatron_core(clean, caplog):
    from megatron.core.distributed import distributed_data_parallel as ddp_module

    cls = ddp_module.DistributedDataParallel
    real_installed_version = registry.installed_version
    originals = {name: vars(cls)[name] for name in ("enable_forward_pre_hook", "disable_forward_pre_hook")}
    fake_version(clean, "0.9.0")
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        result = REG.apply(only="ddp_hooks")
    assert [s.status for s in result] == ["skipped", "skipped"]
    for status in result:
        assert "megatron-core 0.9.0" in status.reason and MCORE_RANGE in status.reason
    warnings = [r.getMessage() for r in caplog.records if r.name == "megatron_rl_patches"]
    assert len(warnings) == 1 and "'ddp_hooks' skipped" in warnings[0]
    assert all(vars(cls)[name] is original for name, original in originals.items())

    with pytest.raises(registry.PatchVersionUnsupported, match=r"megatron-core 0\.9\.0 .*>=0\.13,<0\.21"):
        REG.apply(only="ddp_hooks", strict=True)
    assert all(vars(cls)[name] is original for name, original in originals.items())
    assert all(s.code == registry.VERSION for s in REG.applied() if s.name == "ddp_hooks")

    # The override: applied with one warning, also in strict mode; the status says so.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        result = REG.apply(only="ddp_hooks", strict=True, allow_untested=True)
    assert [(s.status, s.code) for s in result] == [("applied", registry.UNTESTED)] * 2
    assert "outside its supported range" in result[0].reason
    warnings = [r.getMessage() for r in caplog.records if r.name == "megatron_rl_patches"]
    assert len(warnings) == 1 and "ALLOW_UNTESTED" in warnings[0]
    REG.revert()

    from megatron_rl_patches.integrations.megatron import version as megatron_version

    clean.setattr(registry, "installed_version", real_installed_version)  # the real one is in range
    clean.setattr(megatron_version, "installed_version", lambda: megatron_version.megatron_info().version)
    assert [s.status for s in REG.apply(only="ddp_hooks")] == ["applied", "applied"]
    assert vars(cls)["enable_forward_pre_hook"].__wrapped__ is originals["enable_forward_pre_hook"]
    REG.revert()
    assert all(vars(cls)[name] is original for name, original in originals.items())


def test_version_checked_when_the_module_is_imported_later(clean, tmp_path):
    name = "standin_versioned_module"
    (tmp_path / f"{name}.py").write_text("def f(x):\n    return x\n")
    clean.syspath_prepend(str(tmp_path))
    patch = Patch("ddp_hooks", f"{name}:f", lambda w, i, a, k: "spy", "d", requires="megatron-core", versions=">=0.14")
    reg = Registry([patch])
    fake_version(clean, "0.9.0")
    assert reg.apply(strict=True)[0].status == "pending"
    try:
        with pytest.raises(registry.PatchVersionUnsupported, match=r"0\.9\.0.*>=0\.14"):
            importlib.import_module(name)  # strict: the post-import hook fails the import
        reg.revert()
        reg.apply(strict=False)
        module = importlib.import_module(name)
        assert module.f(3) == 3 and reg.applied()[0].status == "skipped"
    finally:
        sys.modules.pop(name, None)


def test_missing_target_attribute(fake_slime, slime_standin_source, caplog):
    module = fake_slime(slime_standin_source.replace("def enable_forward_pre_hook", "def renamed_enable"))
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        REG.apply(only="train_reentry")
    found = {s.target: s for s in REG.applied() if s.target.startswith(SLIME_MODULE)}
    missing = found[f"{SLIME_MODULE}:enable_forward_pre_hook"]
    assert missing.status == "skipped"
    assert f"{SLIME_MODULE}:enable_forward_pre_hook not found" in missing.reason
    assert found[f"{SLIME_MODULE}:train"].status == "applied"
    assert any("enable_forward_pre_hook" in r.getMessage() for r in caplog.records)
    REG.revert()
    with pytest.raises(registry.PatchTargetMissing, match=f"{SLIME_MODULE}:enable_forward_pre_hook"):
        REG.apply(only="train_reentry", strict=True)
    assert not hasattr(module, "enable_forward_pre_hook")


def test_changed_signature(fake_slime, slime_standin_source):
    changed = slime_standin_source.replace("def train(rollout_id, model,", "def train(step, models,")
    module = fake_slime(changed)
    original = module.train
    REG.apply(only="train_reentry")
    status = {s.target: s for s in REG.applied()}[f"{SLIME_MODULE}:train"]
    assert status.status == "skipped"
    assert f"{SLIME_MODULE}:train has parameters (step, models," in status.reason
    assert "rollout_id, model, optimizer" in status.reason
    assert module.train is original
    REG.revert()
    with pytest.raises(registry.PatchSignatureMismatch, match=f"{SLIME_MODULE}:train has parameters"):
        REG.apply(only="train_reentry", strict=True)
    assert module.train is original


def test_allow_untested_from_the_environment(clean, caplog):
    """MEGATRON_RL_PATCHES_ALLOW_UNTESTED=1 is the zero-code override; `allow_untested=False`
    beats it; a non-bool argument is a TypeError and changes nothing."""
    patch = one_record(MCORE_RANGE)
    reg = Registry([patch])
    fake_version(clean, "0.21.0")
    with pytest.raises(TypeError, match="allow_untested must be True, False or None"):
        reg.apply(allow_untested="yes")
    assert reg.applied()[0].code == registry.NOT_SELECTED
    environ = {"MEGATRON_RL_PATCHES_ALLOW_UNTESTED": "1"}
    assert reg.apply(allow_untested=False, environ=environ)[0].status == "skipped"
    reg.revert()
    status = reg.apply(environ=environ)[0]
    assert (status.status, status.code) == ("applied", registry.UNTESTED) and "0.21.0" in status.reason
    import json

    assert json.dumps({"x": 1}) == "spy"  # the record's wrapper is really in place
    reg.revert()
    assert patch.target == "json:dumps" and json.dumps({"x": 1}) == '{"x": 1}'
