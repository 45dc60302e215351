"""`megatron-rl-patches run` over odd values of --patches and of every variable it passes on
(empty, whitespace, unicode, duplicates, conflicting DISABLE), one real launch per case: the exit
code, the one stderr line of a refusal (naming what is wrong), and which patches the child applied."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl_patches.integrations import default_registry

ALL = tuple(default_registry().patch_names())
OTHERS = tuple(name for name in ALL if name != "ddp_hooks")
REPORT = ("import json, megatron_rl_patches as m; "
          "print(json.dumps(sorted({s.name for s in m.applied() if s.status in ('applied', 'pending')})))")

SELECT, DISABLE = "MEGATRON_RL_PATCHES", "MEGATRON_RL_PATCHES_DISABLE"
STRICT, UNTESTED = "MEGATRON_RL_PATCHES_STRICT", "MEGATRON_RL_PATCHES_ALLOW_UNTESTED"
BACKEND, ROLES = "MEGATRON_RL_PATCHES_BACKEND", "MEGATRON_RL_PATCHES_INFERENCE_ROLES"
OPD = "MEGATRON_RL_PATCHES_OPD_"
INVARIANT, VERL_ROWS = "MEGATRON_RL_PATCHES_INVARIANT", "MEGATRON_RL_PATCHES_VERL_ROWS"
NATIVE = "MEGATRON_RL_PATCHES_NATIVE"
SHARED_PREFIX = "MEGATRON_RL_PATCHES_SHARED_PREFIX"

# (case id, --patches or None, variables) -> applied names (exit 0) or the text of the refusal (exit 2)
CASES = [
    ("nothing-set", None, {}, ALL),
    ("select-empty", None, {SELECT: ""}, ALL),
    ("select-whitespace", None, {SELECT: " \t "}, ALL),
    ("select-0", None, {SELECT: "0"}, "MEGATRON_RL_PATCHES='0' disables patching; unset it or pass --patches"),
    ("select-off", None, {SELECT: " Off "}, "disables patching"),
    ("select-ALL", None, {SELECT: "ALL"}, ALL),
    ("select-duplicates", None, {SELECT: "ddp_hooks, ddp_hooks,ddp_hooks"}, ("ddp_hooks",)),
    ("select-spaced-pair", None, {SELECT: " ddp_hooks , train_reentry "}, ("ddp_hooks", "train_reentry")),
    ("select-commas", None, {SELECT: " , ,"}, "MEGATRON_RL_PATCHES=' , ,' names no patch"),
    ("select-unicode", None, {SELECT: "ddp_höoks"}, "unknown patch name(s) 'ddp_höoks' in MEGATRON_RL_PATCHES"),
    ("patches-empty", "", {}, "--patches names no patch"),
    ("patches-commas", " , ", {}, "--patches names no patch"),
    ("patches-duplicates", "ddp_hooks,,ddp_hooks", {}, ("ddp_hooks",)),
    ("patches-beat-select-0", "ddp_hooks", {SELECT: "0"}, ("ddp_hooks",)),
    ("patches-fullwidth", "ｄｄｐ_hooks", {}, "unknown patch name(s)"),
    ("disable-typo", None, {DISABLE: "ddp_hook"}, "unknown patch name(s) 'ddp_hook' in MEGATRON_RL_PATCHES_DISABLE"),
    ("disable-one", None, {DISABLE: "ddp_hooks"}, OTHERS),
    ("disable-duplicates", None, {DISABLE: "ddp_hooks , ddp_hooks"}, OTHERS),
    ("disable-empty", None, {DISABLE: ""}, ALL),
    ("disable-commas", None, {DISABLE: " , "}, "MEGATRON_RL_PATCHES_DISABLE=' , ' names no patch"),
    ("disable-zero-width", None, {DISABLE: "ddp_hooks\u200b"}, "in MEGATRON_RL_PATCHES_DISABLE"),
    ("disable-conflicts-patches", "ddp_hooks", {DISABLE: "ddp_hooks"}, "leaves out every patch selected"),
    ("disable-conflicts-select", None, {SELECT: "ddp_hooks", DISABLE: "ddp_hooks"}, "leaves out every patch"),
    ("disable-everything", None, {DISABLE: ",".join(ALL)}, "leaves out every patch selected"),
    ("disable-part-of-patches", "ddp_hooks,train_reentry", {DISABLE: "ddp_hooks"}, ("train_reentry",)),
    ("strict-yes", None, {STRICT: " YES "}, ALL),
    ("strict-whitespace", None, {STRICT: "  "}, ALL),
    ("strict-maybe", None, {STRICT: "maybe"}, "MEGATRON_RL_PATCHES_STRICT='maybe' is not a switch: use 1/true/yes/on"),
    ("strict-fullwidth-1", None, {STRICT: "１"}, "MEGATRON_RL_PATCHES_STRICT='１'"),
    ("untested-on", None, {UNTESTED: "on"}, ALL),
    ("untested-2", None, {UNTESTED: "2"}, "MEGATRON_RL_PATCHES_ALLOW_UNTESTED='2' is not a switch: use 1/true/yes/on"),
    ("backend-triton", None, {BACKEND: "triton"}, ALL),
    ("backend-spaced-upper", None, {BACKEND: " TORCH "}, ALL),
    ("backend-empty", None, {BACKEND: ""}, ALL),
    ("backend-cuda", None, {BACKEND: "cuda"},
     "MEGATRON_RL_PATCHES_BACKEND='cuda' is not a backend: use torch or triton or gemm"),
    ("backend-greek-o", None, {BACKEND: "tοrch"}, "MEGATRON_RL_PATCHES_BACKEND="),
    # issue 63 item 1: the documented switch was an unknown variable (exit 2); its value checked up front
    ("invariant-on", None, {INVARIANT: "1"}, ALL),
    ("invariant-tru", None, {INVARIANT: "tru"},
     "MEGATRON_RL_PATCHES_INVARIANT='tru' is not a switch: use 1/true/yes/on (invariant vocabulary ops) or "
     "0/false/no/off (the default mode)"),
    ("native-off", None, {NATIVE: " Off "}, ALL),
    ("native-typo", None, {NATIVE: "of"},
     "MEGATRON_RL_PATCHES_NATIVE='of' is not a switch: use 1/true/yes/on (the compiled kernel) or 0/false/no/off "
     "(the torch tiles)"),
    # issue 106: read by slime's patch at its door; its value checked up front
    ("shared-prefix-on", None, {SHARED_PREFIX: " 1 "}, ALL),
    ("shared-prefix-maybe", None, {SHARED_PREFIX: "maybe"},
     "MEGATRON_RL_PATCHES_SHARED_PREFIX='maybe' is not a switch: use 1/true/yes/on (pack by shared prefix) "
     "or 0/false/no/off (each sample whole)"),
    ("verl-rows-all", None, {VERL_ROWS: " ALL "}, ALL),
    ("verl-rows-typo", None, {VERL_ROWS: "al"}, "MEGATRON_RL_PATCHES_VERL_ROWS='al' is not a row choice"),
    ("teacher-api-key", None, {"MEGATRON_RL_PATCHES_TEACHER_API_KEY": "k-123"}, ALL),  # read by ServedTeacher only
    # read by verl's teacher-loop client only, when verl asks its teacher
    ("verl-teacher", None, {"MEGATRON_RL_PATCHES_VERL_TEACHER": "http://127.0.0.1:1;engine=vllm"}, ALL),
    ("roles-custom", None, {ROLES: "teacher, ref_model"}, ALL),
    ("roles-empty", None, {ROLES: ""}, ALL),
    ("roles-duplicates", None, {ROLES: "teacher:swap,teacher:stream"}, "lists role 'teacher' more than once"),
    ("roles-unicode-identifier", None, {ROLES: "教师"}, ALL),
    ("roles-commas", None, {ROLES: " , "}, "MEGATRON_RL_PATCHES_INFERENCE_ROLES=' , ' names no role"),
    ("roles-dash", None, {ROLES: "teacher,prm-teacher"}, "'prm-teacher' is not a role name"),
    # a framework's own variables, as its patch reads them (issue 38: top-k OPD's were read at the first step)
    ("opd-ids-from", None, {OPD + "TEACHERS": "/ckpt/t", OPD + "IDS_FROM": "teachers"},
     "MEGATRON_RL_PATCHES_OPD_IDS_FROM='teachers'"),
    ("opd-weights", None, {OPD + "TEACHERS": "/a,/b", OPD + "WEIGHTS": "2,3"},
     "MEGATRON_RL_PATCHES_OPD_WEIGHTS='2,3' sums to 5"),
    ("opd-k-vocab", None, {OPD + "TEACHERS": "/a,/b", OPD + "K": "vocab"}, ALL),  # full-vocabulary OPD
    ("opd-k-vocab-top-k-server", None, {OPD + "TEACHERS": "/a,http://t:1;engine=vllm", OPD + "K": "vocab"},
     "MEGATRON_RL_PATCHES_OPD_K=vocab: MEGATRON_RL_PATCHES_OPD_TEACHERS entry 'http://t:1' is a served teacher "
     "without a head"),
    # misspelled names with our prefix (issue 49: ignored, `run` then defaulted to all)
    ("misspelled-select", None, {"MEGATRON_RL_PATCH": "ddp_hooks"},
     "unknown variable(s) MEGATRON_RL_PATCH (did you mean MEGATRON_RL_PATCHES?)"),
    ("misspelled-disable", None, {"MEGATRON_RL_PATCHES_DISABLED": "ddp_hooks"},
     "unknown variable(s) MEGATRON_RL_PATCHES_DISABLED (did you mean MEGATRON_RL_PATCHES_DISABLE?)"),
    ("misspelled-opd-teachers", None, {OPD + "TEACHER": "/ckpt/t"},
     "unknown variable(s) MEGATRON_RL_PATCHES_OPD_TEACHER (did you mean MEGATRON_RL_PATCHES_OPD_TEACHERS?)"),
    ("lower-case-select", None, {"megatron_rl_patches": "all"}, "unknown variable(s) megatron_rl_patches"),
]
MISSPELLED = {"MEGATRON_RL_PATCH", "MEGATRON_RL_PATCHES_DISABLED", OPD + "TEACHER", "megatron_rl_patches"}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every case launched at once (each launch starts two interpreters)."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("MEGATRON_RL_PATCH")}
    procs = {}
    for case, patches, variables, _ in CASES:
        marker = tmp_path_factory.mktemp(case) / "started"
        selection = [] if patches is None else ["--patches", patches]
        child = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close(); {REPORT}"]
        procs[case] = (marker, subprocess.Popen(
            [sys.executable, "-m", "megatron_rl_patches", "run", *selection, "--", *child],
            env={**base, **variables}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
        ))
    return {case: (proc.wait(timeout=300), *proc.communicate(), marker.exists())
            for case, (marker, proc) in procs.items()}


@pytest.mark.parametrize("case, patches, variables, expected", CASES, ids=[case[0] for case in CASES])
def test_launch(launches, case, patches, variables, expected):
    code, out, err, started = launches[case]
    if isinstance(expected, str):
        assert (code, started) == (2, False), (out, err)
        assert err.count("\n") == 1 and err.startswith("megatron-rl-patches run: ") and expected in err, err
    else:
        assert (code, started) == (0, True), err
        assert json.loads(out.strip().splitlines()[-1]) == sorted(expected), err


def test_the_table_covers_every_variable_the_launcher_passes_on():
    from megatron_rl_patches.patching import env

    covered = {name for _, _, variables, _ in CASES for name in variables} - MISSPELLED
    assert {name for name in covered if not name.startswith(OPD)} == {
        name for name in env.VARIABLES if not name.startswith(OPD)}
