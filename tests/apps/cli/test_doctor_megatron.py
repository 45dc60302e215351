"""`doctor`: where megatron-core comes from (installed distribution or source checkout), its version,
and per patch the supported range, the tested label and the status."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.integrations.megatron import version as megatron_version
from megatron_rl_patches.patching.startup import files as startup


@pytest.fixture(autouse=True)
def no_site_files(clean_patch_state, tmp_path):
    clean_patch_state.setattr(startup, "site_dirs", lambda: [str(tmp_path)])
    return tmp_path


def doctor(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["doctor", *argv])
    return code, capsys.readouterr().out


def _expected_origin() -> str:
    """Independently of the package: "distribution" when the megatron/core Python imports is the
    installed megatron-core wheel's own folder, else "source" (a checkout on PYTHONPATH)."""
    import importlib.metadata
    import importlib.util

    imported = os.path.realpath(os.path.dirname(importlib.util.find_spec("megatron.core").origin))
    try:
        wheel = os.path.realpath(str(importlib.metadata.distribution("megatron-core").locate_file("megatron/core")))
    except importlib.metadata.PackageNotFoundError:
        return "source"
    return "distribution" if wheel == imported else "source"


@pytest.mark.megatron  # needs megatron-core: runs in every lane (and on a checkout by make test-source)
def test_doctor_reports_the_megatron_in_use(capsys):
    info = megatron_version.megatron_info()
    code, out = doctor(capsys, "--json")
    report = json.loads(out)
    m = report["megatron"]
    assert code == 0, report["problems"]
    assert (m["version"], m["origin"], m["location"]) == (info.version, info.origin, info.location)
    assert m["origin"] == _expected_origin() and m["supported"] == megatron_version.SUPPORTED
    assert m["tested"] == ("tested" if m["version"] in megatron_version.TESTED else "in range, not run")
    ddp = [t for t in report["targets"] if t["name"] == "ddp_hooks"]
    assert len(ddp) == 2
    for t in ddp:
        assert (t["versions"], t["installed"], t["tested"]) == (megatron_version.SUPPORTED, m["version"], m["tested"])
        assert (t["status"], t["code"]) == ("skipped", "not_selected")

    assert not [p for p in report["problems"] if "megatron" in p], report["problems"]  # nothing out of range
    code, text = doctor(capsys)
    where = "installed distribution" if m["origin"] == "distribution" else "source checkout"
    assert f"megatron-core        {m['version']} ({where}: {m['location']})" in text
    assert f"supported '{megatron_version.SUPPORTED}': {m['tested']}" in text


def test_doctor_shows_each_patch_status(capsys):
    default_registry().apply(only="slime_logprobs")  # slime is not importable here: pending
    code, out = doctor(capsys, "--json")
    rows = json.loads(out)["targets"]
    assert {t["status"] for t in rows if t["name"] == "slime_logprobs"} == {"pending"}
    assert {t["code"] for t in rows if t["name"] != "slime_logprobs"} == {"not_selected"}
    code, text = doctor(capsys)
    lines = [line.split() for line in text.splitlines() if line.startswith("  ")]
    assert {words[1] for words in lines if words[0] == "slime_logprobs"} == {"pending"}
    assert {words[1] for words in lines if words[0] == "ddp_hooks"} == {"off"}


def test_doctor_reports_a_source_checkout(tmp_path):
    """Megatron-LM on PYTHONPATH, no distribution: its version is read from package_info.py, and
    megatron is never imported (its __init__ raises)."""
    checkout = tmp_path / "Megatron-LM"
    core = checkout / "megatron" / "core"
    core.mkdir(parents=True)
    (checkout / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("raise ImportError('doctor imported megatron.core')\n")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = 'rc0'\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "megatron_rl_patches", "doctor"]
    proc = subprocess.run([*command, "--json"], env=environ, capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout)
    m = report["megatron"]
    assert (m["version"], m["origin"], m["location"]) == ("0.20.0rc0", "source", os.path.realpath(core))
    assert m["tested"] == "in range, not run"
    ddp = [t for t in report["targets"] if t["name"] == "ddp_hooks"]
    assert ddp and all((t["installed"], t["tested"]) == ("0.20.0rc0", "in range, not run") for t in ddp)
    assert not [p for p in report["problems"] if "megatron" in p], report["problems"]
    text = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120).stdout
    assert f"megatron-core        0.20.0rc0 (source checkout: {os.path.realpath(core)})" in text
    assert "0.20.0rc0: in range, not run" in text


@pytest.mark.megatron
def test_doctor_says_out_of_range(capsys, clean_patch_state):
    found = megatron_version.megatron_info()
    clean_patch_state.setattr(megatron_version, "megatron_info",
                              lambda: megatron_version.MegatronInfo("0.9.0", found.origin, found.location))
    code, out = doctor(capsys, "--json")
    report = json.loads(out)
    assert code == 1 and report["megatron"]["tested"] == "out of range"
    assert {t["tested"] for t in report["targets"] if t["name"] == "ddp_hooks"} == {"out of range"}
    assert any("megatron-core 0.9.0 is outside the supported range" in p for p in report["problems"])
    code, text = doctor(capsys)
    assert code == 1 and "0.9.0: OUT OF RANGE" in text


def test_doctor_reports_bad_yes_no_values(capsys, clean_patch_state):
    clean_patch_state.setenv("MEGATRON_RL_PATCHES_STRICT", "maybe")
    code, out = doctor(capsys, "--json")
    report = json.loads(out)
    assert code == 1 and report["environment"]["strict"] is None
    assert any("MEGATRON_RL_PATCHES_STRICT='maybe'" in p for p in report["problems"])
