"""`megatron-rl-patches run`: every Python child applies the patches at start-up, in an editable
install (no start-up file), chaining to a `sitecustomize` of its own, and under torchrun."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl_patches.patching.startup import launcher

# What a child reports: was the package's bootstrap run, and with which selection.
REPORT = textwrap.dedent(
    """
    import json, os, sys
    boot = sys.modules.get("megatron_rl_patches.patching.startup.hook")
    print(json.dumps({"bootstrap_ran": bool(boot and boot.has_run()),
                      "selection": os.environ.get("MEGATRON_RL_PATCHES"),
                      "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
                      "marker": os.environ.get("OWN_SITECUSTOMIZE_RAN")}))
    """
)


def launched(command: list[str], patches: str | None = "ddp_hooks", **extra_env: str) -> subprocess.CompletedProcess:
    """Run `command` through the real CLI command, `megatron-rl-patches run`, in a fresh process
    (which execs the command)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ.update(extra_env)
    selection = [] if patches is None else ["--patches", patches]
    cli = [sys.executable, "-m", "megatron_rl_patches", "run", *selection, "--", *command]
    return subprocess.run(cli, env=environ, capture_output=True, text=True, timeout=300)


def test_plain_python_child_runs_the_bootstrap_without_any_startup_file():
    from megatron_rl_patches.patching.startup import files as startup

    installed = [f.path for d in startup.site_dirs() for f in startup.inspect_dir(d) if f.present]
    proc = launched([sys.executable, "-c", REPORT])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bootstrap_ran"] and report["selection"] == "ddp_hooks"
    assert Path(report["sitecustomize"]).parent == Path(launcher.LAUNCH_DIR)
    assert not installed, "this check needs an install without the .pth start-up file (e.g. editable)"


def test_without_the_launcher_nothing_runs():
    """The control: the same child, same selection, no launcher (editable install: no .pth)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ["MEGATRON_RL_PATCHES"] = "ddp_hooks"
    proc = subprocess.run([sys.executable, "-c", REPORT], env=environ, capture_output=True, text=True, timeout=120)
    assert json.loads(proc.stdout)["bootstrap_ran"] is False


def test_a_childs_own_sitecustomize_still_runs(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE_RAN'] = 'yes'\n")
    proc = launched([sys.executable, "-c", REPORT], PYTHONPATH=str(own))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bootstrap_ran"] and report["marker"] == "yes"
    assert Path(report["sitecustomize"]) == own / "sitecustomize.py"  # the process sees its own module


def test_exit_code_and_missing_command():
    assert launched([sys.executable, "-c", "raise SystemExit(7)"]).returncode == 7
    proc = launched(["no-such-command-mrp"])
    assert proc.returncode == 127 and proc.stderr == "megatron-rl-patches run: no-such-command-mrp: command not found\n"


def _garbage(path):
    path.write_bytes(b"\x7fELF not really a program")
    path.chmod(0o755)


def _missing_interpreter(path):
    path.write_text("#!/no/such/interpreter-mrp\necho hi\n")
    path.chmod(0o755)


def _without_run_bit(path):
    path.write_text("#!/bin/sh\necho hi\n")
    path.chmod(0o644)


@pytest.mark.parametrize("make, code, message", [
    (lambda path: path.mkdir(), 126, "Is a directory"),
    (_without_run_bit, 126, "Permission denied"),
    (_garbage, 126, "Exec format error"),
    (_missing_interpreter, 126, "bad interpreter: No such file or directory"),
    (lambda path: None, 127, "No such file or directory"),
])
def test_a_command_that_cannot_be_executed_exits_like_the_shell(tmp_path, make, code, message):
    """126 when the file is there but cannot run, 127 when it is not: one line, no traceback."""
    make(tmp_path / "x")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", "run", "--patches", "ddp_hooks", "--", "./x"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == code and proc.stderr == f"megatron-rl-patches run: ./x: {message}\n", proc.stderr


def test_a_file_on_path_without_the_run_bit_is_permission_denied(tmp_path):
    _without_run_bit(tmp_path / "mrp-not-runnable")
    environ = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", "run", "--", "mrp-not-runnable"],
                          env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 126 and proc.stderr.endswith(": mrp-not-runnable: Permission denied\n"), proc.stderr


@pytest.mark.parametrize("given, passed_on", [
    (None, []), ("", []), (":", ["", ""]), ("/a::/b", ["/a", "", "/b"]), ("/a:", ["/a", ""]),
])
def test_pythonpath_is_passed_on_entry_for_entry(given, passed_on):
    """An empty entry means the current directory to Python: kept; none added when there was none."""
    environ = {} if given is None else {"PYTHONPATH": given.replace(":", os.pathsep)}
    child = launcher.launch_environment(None, environ=environ)
    assert child["PYTHONPATH"].split(os.pathsep) == [launcher.LAUNCH_DIR, *passed_on]


def test_an_empty_pythonpath_entry_still_means_the_current_directory(tmp_path):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (here / "mrp_local_mod.py").write_text("VALUE = 'found'\n")
    (elsewhere / "s.py").write_text("import mrp_local_mod\nprint(mrp_local_mod.VALUE)\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    # an explicit empty entry (the issue's `PYTHONPATH=:`); a wholly empty PYTHONPATH adds nothing
    environ["PYTHONPATH"] = os.pathsep.join([*filter(None, [os.environ.get("PYTHONPATH")]), "", ""])
    plain = subprocess.run([sys.executable, str(elsewhere / "s.py")], cwd=here, env=environ,
                           capture_output=True, text=True, timeout=120)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", "run", "--", sys.executable,
                           str(elsewhere / "s.py")], cwd=here, env=environ, capture_output=True, text=True, timeout=120)
    assert plain.stdout == proc.stdout == "found\n", (plain.stderr, proc.stderr)


def test_usage_errors_exit_2_and_run_nothing(tmp_path):
    marker = tmp_path / "ran"
    child = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for patches in ("ddp_hooks,bogus", " "):
        proc = launched(child, patches=patches)
        assert proc.returncode == 2 and "megatron-rl-patches run:" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", "run"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no command given" in proc.stderr
    assert not marker.exists()


def test_selection_defaults_to_the_environment_then_all():
    inherited = launched([sys.executable, "-c", REPORT], patches=None, MEGATRON_RL_PATCHES="train_reentry")
    assert json.loads(inherited.stdout.strip().splitlines()[-1])["selection"] == "train_reentry"
    default = launched([sys.executable, "-c", REPORT], patches=None)
    assert json.loads(default.stdout.strip().splitlines()[-1])["selection"] == "all"


def test_bad_selection_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="'bogus'"):
        launcher.launch_environment("ddp_hooks,bogus", environ={})
    with pytest.raises(ValueError, match="--patches"):
        launcher.launch_environment("  ", environ={})
    environ = launcher.launch_environment(None, environ={"PYTHONPATH": "/a"})
    assert environ["MEGATRON_RL_PATCHES"] == "all"
    assert environ["PYTHONPATH"].split(os.pathsep) == [launcher.LAUNCH_DIR, "/a"]
    again = launcher.launch_environment(None, environ=environ)  # nested launchers: one entry
    assert again["PYTHONPATH"] == environ["PYTHONPATH"]


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel as DDP
    patched = torch.tensor([int(hasattr(DDP.enable_forward_pre_hook, "__wrapped__"))])
    dist.all_reduce(patched)  # how many ranks are patched
    if dist.get_rank() == 0:
        print(f"RESULT {int(patched)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: on the 3.12 lane a C++ thread of torch's at that
    # teardown now and then aborts the process ("terminate called without an active exception",
    # SIGABRT) after the work above is done, which is not what this test is about.
    import os, sys
    sys.stdout.flush()
    os._exit(0)
    """
)


# version-blind: the main lane only (torchrun's workers inherit the launcher's start-up whatever the
# megatron-core); the start-up patching megatron-core's DDP, on every megatron lane:
# tests/test_reentrant_train.py::test_env_var_patches_a_fresh_process
@pytest.mark.megatron
@pytest.mark.version_blind
@pytest.mark.slow
def test_torchrun_workers_are_patched(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_SCRIPT)
    proc = launched([torchrun, "--standalone", "--nproc-per-node", "2", str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    assert line == "RESULT 2"  # both workers patched, with no import of ours in the script
