"""The `megatron-rl-patches` CLI: list, doctor, startup, lazy sub-command modules, exit codes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.apps.cli.targets import find_module
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.patching.startup import files as startup

REPO = Path(__file__).resolve().parents[3]
PATCH_NAMES = {"ddp_hooks", "train_reentry", "inference_roles", "slime_logprobs", "gpt_output_processor",
              "grad_windows", "verl_fused_logprobs", "verl_topk_kd", "slime_fused", "slime_opd",
              "hybrid_output_processor", "mtp_output_processor", "nemo_rl_fused_logprobs", "nemo_rl_topk",
              "nemo_rl_topk_kd", "nemo_rl_shared_prefix"}




def test_list_json(cli_run):
    code, out, _ = cli_run("list", "--json")
    assert code == 0
    rows = json.loads(out)
    assert {row["name"] for row in rows} == PATCH_NAMES
    assert len(rows) == len(default_registry().patches())
    ddp = [row for row in rows if row["name"] == "ddp_hooks"]
    assert {row["target"].rsplit(".", 1)[1] for row in ddp} == {"enable_forward_pre_hook", "disable_forward_pre_hook"}
    assert all(row["requires"] == "megatron-core" and row["versions"] == ">=0.13,<0.21" for row in ddp)
    assert all(row["status"] == "skipped" and row["reason"] == "not selected" for row in rows)
    assert all(row["code"] == "not_selected" for row in rows)
    assert set(rows[0]) == {"name", "target", "requires", "versions", "installed", "description", "status", "code",
                            "reason"}


def test_list_text_shows_every_target(cli_run):
    code, out, _ = cli_run("list")
    assert code == 0
    assert all(patch.target in out for patch in default_registry().patches())


def test_list_apply_uses_the_environment(cli_run, clean):
    code, out, err = cli_run("list", "--apply", "--json")
    assert code == 0 and "start-up applies nothing" in err
    assert {row["status"] for row in json.loads(out)} == {"skipped"}

    clean.setenv("MEGATRON_RL_PATCHES", "slime_logprobs")
    code, out, _ = cli_run("list", "--apply", "--json")
    states = {(row["name"], row["status"]) for row in json.loads(out)}
    assert code == 0 and ("slime_logprobs", "pending") in states
    assert {status for name, status in states if name != "slime_logprobs"} == {"skipped"}

    clean.setenv("MEGATRON_RL_PATCHES", "bogus")
    code, out, err = cli_run("list", "--apply")
    assert code == 2 and "'bogus'" in err and out == ""


@pytest.fixture
def no_site_files(clean, tmp_path):
    clean.setattr(startup, "site_dirs", lambda: [str(tmp_path)])
    return tmp_path


def test_doctor_json(cli_run, no_site_files):
    code, out, _ = cli_run("doctor", "--json")
    report = json.loads(out)
    assert code == 0, report["problems"]
    assert report["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    for name in ("torch", "megatron-core", "wrapt", "packaging"):
        assert report["packages"][name], name
    ddp = [t for t in report["targets"] if t["name"] == "ddp_hooks"]
    assert ddp and all(t["module_found"] and t["in_range"] is True for t in ddp)
    slime = [t for t in report["targets"] if t["target"].startswith("slime.")]
    assert slime and not any(t["module_found"] for t in slime)  # slime is not installed here
    assert report["environment"]["enabled_at_startup"] is False
    assert report["startup"]["pth_installed"] is False and report["problems"] == []


def test_doctor_reports_problems(cli_run, no_site_files, clean):
    clean.setenv("MEGATRON_RL_PATCHES", "ddp_hooks,bogus")
    (no_site_files / startup.PTH_NAME).write_text("import something_else\n")
    code, out, _ = cli_run("doctor", "--json")
    report = json.loads(out)
    assert code == 1
    assert report["environment"]["error"] and "'bogus'" in report["environment"]["error"]
    problems = "\n".join(report["problems"])
    assert "is not megatron-rl-patches' start-up file" in problems
    assert "no start-up file is installed" in problems and "startup install" in problems

    from megatron_rl_patches.integrations.megatron import version as megatron_version

    clean.setattr(megatron_version, "installed_version", lambda: "0.9.0")
    clean.setenv("MEGATRON_RL_PATCHES", "ddp_hooks")
    (no_site_files / startup.PTH_NAME).unlink()
    startup.install(str(no_site_files))
    code, out, _ = cli_run("doctor")
    assert code == 1 and "OUT OF RANGE" in out and "megatron-core 0.9.0 is outside" in out


def test_find_module_does_not_run_package_inits(tmp_path, clean):
    pkg = tmp_path / "explosive_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("")
    clean.syspath_prepend(str(tmp_path))
    assert find_module("explosive_pkg.sub.leaf") == (True, None)
    assert find_module("explosive_pkg.sub.missing")[0] is False
    assert find_module("explosive_pkg.sub.leaf.deeper") == (False, "explosive_pkg.sub.leaf is a module, not a package")
    assert find_module("no_such_top_level_pkg") == (False, "no_such_top_level_pkg is not installed")
    assert not any(name.startswith("explosive_pkg") for name in sys.modules)
    assert find_module("json.decoder") == (True, None)


def test_startup_install_remove(cli_run, tmp_path):
    site = str(tmp_path)
    code, out, err = cli_run("startup", "install", "--site", site)
    assert code == 0 and out.count("written") == 2
    assert "not a site directory" in err
    for name, text in startup.CONTENTS.items():
        assert (tmp_path / name).read_text() == text
    code, out, _ = cli_run("startup", "install", "--site", site)
    assert code == 0 and out.count("unchanged") == 2
    code, out, _ = cli_run("startup", "remove", "--site", site)
    assert code == 0 and out.count("removed") == 2 and list(tmp_path.iterdir()) == []
    code, out, _ = cli_run("startup", "remove", "--site", site)
    assert code == 0 and out.count("absent") == 2


def test_startup_refuses_foreign_files_and_bad_dirs(cli_run, tmp_path):
    foreign = tmp_path / startup.START_NAME
    foreign.write_text("somebody_else:run\n")
    for action in ("install", "remove"):
        code, out, err = cli_run("startup", action, "--site", str(tmp_path))
        assert code == 1 and "refusing" in err and str(foreign) in err
    assert foreign.read_text() == "somebody_else:run\n"
    assert not (tmp_path / startup.PTH_NAME).exists()  # nothing half-done
    code, _, err = cli_run("startup", "install", "--site", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    code, _, err = cli_run("startup", "reinstall")
    assert code == 2 and "invalid choice" in err


def test_startup_install_replaces_an_earlier_releases_files(cli_run, tmp_path):
    """Files an earlier release wrote (the hook at patching.bootstrap) are ours: replaced, and
    that old path still runs the hook meanwhile."""
    for name, (text,) in startup.EARLIER_CONTENTS.items():
        (tmp_path / name).write_text(text)
    code, out, _ = cli_run("startup", "install", "--site", str(tmp_path))
    assert code == 0 and out.count("written") == 2
    for name, text in startup.CONTENTS.items():
        assert (tmp_path / name).read_text() == text
    from megatron_rl_patches.patching import bootstrap
    from megatron_rl_patches.patching.startup import hook

    assert bootstrap.run is hook.run


def test_missing_subcommand_module_exits_2(cli_run, clean, tmp_path):
    clean.setitem(cli.COMMANDS, "ghost", ("megatron_rl_patches.no_such_module", "not here yet"))
    code, _, err = cli_run("ghost", "--anything")
    assert code == 2 and "ghost" in err and "megatron_rl_patches.no_such_module" in err
    # a module that exists but misses one of its own dependencies is a failure, not a usage error
    (tmp_path / "needs_dep_cmd.py").write_text("import no_such_dependency_xyz\n")
    clean.syspath_prepend(str(tmp_path))
    clean.setitem(cli.COMMANDS, "needy", ("needs_dep_cmd", "help"))
    code, _, err = cli_run("needy")
    assert code == 1 and "no_such_dependency_xyz" in err


def test_lazy_subcommand_module_is_loaded_and_run(cli_run, clean, tmp_path):
    (tmp_path / "echo_cmd.py").write_text(
        textwrap.dedent(
            """
            def add_arguments(parser):
                parser.add_argument("--times", type=int, default=1)

            def run(args):
                print("echo " * args.times)
                return 3
            """
        )
    )
    clean.syspath_prepend(str(tmp_path))
    clean.setitem(cli.COMMANDS, "echo", ("echo_cmd", "echo"))
    code, out, _ = cli_run("echo", "--times", "2")
    assert code == 3 and out.split() == ["echo", "echo"]
    code, _, err = cli_run("echo", "--times", "x")
    assert code == 2 and "invalid int value" in err
    assert "echo_cmd" in sys.modules
    sys.modules.pop("echo_cmd")
    code, out, _ = cli_run("list", "--json")  # other commands never import it
    assert code == 0 and "echo_cmd" not in sys.modules


def test_usage_errors_and_version(cli_run):
    assert cli_run("nonsense")[0] == 2
    code, _, err = cli_run()
    assert code == 2 and "COMMAND" in err
    code, out, _ = cli_run("--version")
    assert code == 0 and out.strip() == f"megatron-rl-patches {__import__('megatron_rl_patches').__version__}"


def test_console_script_and_module_entry_points_are_cheap():
    """`--help`, `doctor` and `list` import no torch or megatron; `python -m` and the script work."""
    script = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from megatron_rl_patches.apps.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            codes = [main(["--help"]), main(["doctor", "--json"]), main(["list"])]
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron", "numpy"))
        print(json.dumps([codes, heavy]))
        """
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=120)
    codes, heavy = json.loads(proc.stdout)
    assert codes[0] == 0 and codes[2] == 0 and codes[1] in (0, 1) and heavy == []

    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl_patches", "list", "--json"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and {row["name"] for row in json.loads(proc.stdout)} == PATCH_NAMES
    exe = Path(sys.executable).with_name("megatron-rl-patches")
    if exe.exists():  # the console script of the installed distribution
        proc = subprocess.run([str(exe), "--version"], env=environ, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("megatron-rl-patches ")
