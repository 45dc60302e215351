"""Installing megatron-rl-patches never changes the user's megatron-core (or torch).

Each case asks pip what it would install (`pip install --dry-run --report`) from the source tree
into an environment that already has a given Megatron: the running venv's megatron-core, a
fabricated development build, and a source checkout on PYTHONPATH with no distribution at all.
Nothing is installed; torch is never downloaded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow]


def _environ(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "MEGATRON_RL_PATCHES"))}
    environ.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return environ


@pytest.fixture(scope="module")
def source(tmp_path_factory, source_tree_copier) -> Path:
    """A copy of the source tree (pip writes egg-info into the tree it prepares)."""
    return source_tree_copier(tmp_path_factory.mktemp("src"))


def would_install(python: str, requirement: str, **extra_env: str) -> dict[str, str]:
    """{name: version} of what `pip install requirement` would install or replace."""
    proc = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--quiet", "--report", "-", requirement],
        env=_environ(**extra_env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}


def test_metadata_requires_no_megatron_core(source):
    """The requirement list itself: megatron-core only behind the `megatron` extra, torch unpinned."""
    import configparser

    config = configparser.ConfigParser()
    config.read(source / "setup.cfg")
    requires = [line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip()]
    assert not any(line.lower().startswith("megatron") for line in requires)
    assert "torch" in requires  # unpinned: an installed torch of any version satisfies it
    # bounded like the patches' supported range (issue 29: no upper bound although support stops)
    from megatron_rl_patches.integrations.megatron.version import SUPPORTED

    assert config["options.extras_require"]["megatron"].strip() == f"megatron-core{SUPPORTED}" == \
        "megatron-core>=0.13,<0.21"


@pytest.mark.megatron
def test_installed_megatron_core_untouched(source):
    """The lane's megatron-core (0.13.1, 0.16.1 or 0.19.2) stays, with or without the extra."""
    from importlib.metadata import version

    installed = version("megatron-core")
    plan = would_install(sys.executable, str(source))
    assert "megatron-core" not in plan and "torch" not in plan
    assert set(plan) == {"megatron-rl-patches"}, plan
    plan = would_install(sys.executable, f"{source}[megatron]")
    assert "megatron-core" not in plan and "torch" not in plan, f"would replace megatron-core {installed}: {plan}"


def _venv_over_this_one(root: Path) -> str:
    """A venv that sees this interpreter's site-packages (torch, wrapt...) behind its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    # After the venv's own folder, so a dist-info placed there shadows this venv's.
    Path(site, "zz_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return str(python)


def _fake_distribution(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def test_megatron_dev_build_untouched(source, tmp_path):
    """A development build (what Megatron-LM main reports) is neither replaced nor downgraded."""
    python = _venv_over_this_one(tmp_path / "venv")
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip())
    _fake_distribution(site, "megatron-core", "0.20.0.dev0")
    # The venv has no pip of its own: this one's pip plans for it (--python). With the old
    # requirement `megatron-core>=0.13,<0.17` this plan replaced the dev build with 0.16.1.
    target_plan = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--dry-run", "--no-build-isolation", "--quiet",
         "--report", "-", f"{source}[megatron]"],
        env=_environ(), capture_output=True, text=True, timeout=300,
    )
    if "no such option: --python" in target_plan.stderr:
        pytest.skip("this pip has no --python option (pip < 22.3)")
    assert target_plan.returncode == 0, target_plan.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(target_plan.stdout)["install"]}
    assert "megatron-core" not in names and "torch" not in names, names
    assert "megatron-rl-patches" in names


def test_source_checkout_needs_nothing_installed(source, tmp_path):
    """Megatron from a checkout on PYTHONPATH (no distribution): nothing megatron is installed."""
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "core").mkdir(parents=True)
    (checkout / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = 'rc0'\n")
    plan = would_install(sys.executable, str(source), PYTHONPATH=str(checkout))
    assert "megatron-core" not in plan and "torch" not in plan
