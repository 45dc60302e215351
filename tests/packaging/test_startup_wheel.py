"""Zero-code start-up from a real wheel in a fresh virtual environment.

The wheel is built once per session from a copy of the source tree (the `built_wheel` fixture
of tests/conftest.py, shared with the wheel-contents test); a fresh venv gets it with
--no-deps and sees the running venv's torch / megatron-core / wrapt / packaging through a path
line in a .pth (cheap; nothing is copied). Every check runs `python -c ...` in that venv.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from megatron_rl_patches.patching.startup import files as startup

# version-blind: the main lane only (a wheel's start-up files and the venv it goes into do not change with
# megatron-core); the variable patching megatron-core's DDP in a fresh process, on every megatron lane:
# tests/test_reentrant_train.py::test_env_var_patches_a_fresh_process
pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.version_blind]

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "megatron", "wrapt", "packaging", "numpy")
DDP = "megatron.core.distributed.distributed_data_parallel"


def clean_env(**variables: str) -> dict[str, str]:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MEGATRON_RL_PATCHES", "PYTHON", "VIRTUAL_ENV", "PIP_"))
    }
    environ.update(PYTHONWARNINGS="ignore", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    environ.update(variables)
    return environ


def run(cmd: list[str], **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=clean_env(**variables), capture_output=True, text=True, timeout=300)


# torch's own log lines ("W1122 09:50:47.445000 123 torch/utils/cpp_extension.py:178] No CUDA
# runtime is found...", from the CUDA build of torch on a machine without CUDA) are not ours.
_TORCH_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ torch/")


def ours(stderr: str) -> list[str]:
    """stderr lines that are not torch's own logging."""
    return [line for line in stderr.splitlines() if line.strip() and not _TORCH_LOG.match(line)]


@pytest.fixture(scope="session")
def wheel(built_wheel) -> Path:
    return built_wheel.path


def make_venv(root: Path, *extra_paths: str) -> tuple[Path, Path]:
    """A venv without pip whose site-packages reaches the running venv's packages by a path line.

    The .pth name sorts before ours, so wrapt and packaging are importable when our line runs."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    lines = [*extra_paths, sysconfig.get_paths()["purelib"]]
    (site / "00_test_shared_packages.pth").write_text("\n".join(lines) + "\n")
    return python, site


def pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "pip", "--python", str(python), *args])


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory, slime_standin_writer, slime_standin_source):
    root = tmp_path_factory.mktemp("venv")
    python, site = make_venv(root / "env")
    proc = pip(python, "install", "--no-deps", "--no-index", str(wheel))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Run our start-up line a second time from another file, as a venv's lib64 link can do.
    (site / "zz_again.pth").write_text(startup.CONTENTS[startup.PTH_NAME])
    slime = slime_standin_writer(
        root / "slime_src", slime_standin_source.replace("def train(rollout_id, model,", "def train(step, models,")
    )
    return python, site, slime


def py(python: Path, code: str, **variables: str) -> subprocess.CompletedProcess:
    return run([str(python), "-c", textwrap.dedent(code)], **variables)


def test_wheel_ships_the_startup_files(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for name, text in startup.CONTENTS.items():
            assert archive.read(name).decode() == text  # at the wheel root: lands in site-packages
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        listed = {line.split(",")[0] for line in archive.read(record).decode().splitlines()}
        entry_points = archive.read(record.replace("RECORD", "entry_points.txt")).decode()
    assert {startup.PTH_NAME, startup.START_NAME} <= listed  # so pip uninstall removes them
    assert "megatron_rl_patches/py.typed" in names
    assert "megatron-rl-patches = megatron_rl_patches.apps.cli:main" in entry_points


def test_variable_set_patches_megatron_without_code(venv):
    python, site, _ = venv
    proc = py(
        python,
        f"""
        import json, sys
        import wrapt.importer
        hooks = len(wrapt.importer._post_import_hooks.get("{DDP}", []))
        from megatron.core.distributed import DistributedDataParallel as D
        print(hasattr(D.enable_forward_pre_hook, '__wrapped__'))
        import megatron_rl_patches
        print(json.dumps({{"hooks": hooks, "file": megatron_rl_patches.__file__,
                          "statuses": [s.as_dict() for s in megatron_rl_patches.applied()]}}))
        """,
        MEGATRON_RL_PATCHES="all",
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert first == "True"
    info = json.loads(second)
    assert info["file"].startswith(str(site))  # the wheel, not the source checkout
    assert info["hooks"] == 1  # the start-up line ran twice, registered once
    ddp = [s for s in info["statuses"] if s["name"] == "ddp_hooks"]
    assert [s["status"] for s in ddp] == ["applied", "applied"]
    assert ours(proc.stderr) == []


def test_variable_unset_imports_nothing_heavy(venv):
    python, _, _ = venv
    proc = py(python, "import json, sys; print(json.dumps(sorted(sys.modules)))")
    assert proc.returncode == 0 and proc.stderr == ""
    modules = json.loads(proc.stdout)
    assert "megatron_rl_patches.patching.startup.hook" in modules  # the start-up file did run
    assert not [m for m in modules if m.split(".")[0] in HEAVY]


def test_unknown_name_one_stderr_line_exit_0(venv):
    python, _, _ = venv
    proc = py(python, "print('still running')", MEGATRON_RL_PATCHES="bogus")
    assert proc.returncode == 0 and proc.stdout == "still running\n"
    lines = ours(proc.stderr)
    assert len(lines) == 1 and "'bogus'" in lines[0] and "ddp_hooks" in lines[0]


def test_failing_patch_one_stderr_line_exit_0_and_strict_raises_at_import(venv):
    python, _, slime = venv
    code = "import slime.backends.megatron_utils.model as m; print(type(m.train).__name__)"
    proc = py(python, code, MEGATRON_RL_PATCHES="train_reentry", PYTHONPATH=str(slime))
    assert proc.returncode == 0 and proc.stdout == "function\n"  # left unwrapped
    lines = ours(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "'train_reentry' skipped" in lines[0] and "slime.backends.megatron_utils.model:train" in lines[0]

    proc = py(python, code, MEGATRON_RL_PATCHES="train_reentry", MEGATRON_RL_PATCHES_STRICT="1", PYTHONPATH=str(slime))
    assert proc.returncode == 1
    assert "PatchSignatureMismatch: slime.backends.megatron_utils.model:train has parameters" in proc.stderr


def test_startup_cli_route_for_editable_installs(venv, tmp_path):
    _, _, slime = venv
    # Like `pip install -e`: the package comes from the source tree, no start-up file installed.
    python, site = make_venv(tmp_path / "editable", str(REPO))
    check = (
        "import megatron_rl_patches, slime.backends.megatron_utils.model as m;"
        "print(megatron_rl_patches.__file__); print(hasattr(m.enable_forward_pre_hook, '__wrapped__'))"
    )
    variables = dict(MEGATRON_RL_PATCHES="train_reentry", PYTHONPATH=str(slime))
    proc = py(python, check, **variables)
    where, patched = proc.stdout.split()
    assert where.startswith(str(REPO)) and patched == "False"

    cli = [str(python), "-m", "megatron_rl_patches", "startup"]
    proc = run([*cli, "install"])
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert sorted(p.name for p in site.iterdir() if p.name.startswith("megatron_rl_patches")) == [
        startup.PTH_NAME,
        startup.START_NAME,
    ]
    proc = py(python, check, **variables)
    assert proc.stdout.split()[1] == "True", proc.stderr

    assert run([*cli, "remove"]).returncode == 0
    assert not [p for p in site.iterdir() if p.name.startswith("megatron_rl_patches")]
    assert py(python, check, **variables).stdout.split()[1] == "False"


def test_uninstall_leaves_no_startup_file(venv):  # keep last: it removes the package
    python, site, _ = venv
    (site / "zz_again.pth").unlink()
    proc = pip(python, "uninstall", "-y", "megatron-rl-patches")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left = sorted(p.name for p in site.iterdir())
    assert startup.PTH_NAME not in left and startup.START_NAME not in left
    assert not [name for name in left if name.startswith("megatron_rl_patches")]
