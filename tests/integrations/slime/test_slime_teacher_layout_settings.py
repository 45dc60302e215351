"""Where users set a teacher's own layout (issue 58 item 2), the settings alone (no torch world):
`PATH;tp=N` in MEGATRON_RL_PATCHES_OPD_TEACHERS and `role;tp=N` in MEGATRON_RL_PATCHES_INFERENCE_ROLES
are parsed, every bad value refused by name where the setting is read, and a well-formed value
that the run cannot serve (a snapshot teacher or role, the union of ids, a world the size does not
divide, a student with pipeline or context parallelism) refused by name before anything loads."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout
from megatron_rl_patches.integrations.megatron.opd import hf_teachers, layout_teacher
from megatron_rl_patches.integrations.megatron.opd.layout_role import check_role_layout
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, Teacher, opd_settings
from megatron_rl_patches.integrations.slime import opd as slime_opd
from megatron_rl_patches.patching import env
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
from tests.integrations.slime.tiny_actor import TinyActor


def _teachers(value: str) -> tuple[Teacher, ...]:
    settings = opd_settings({TEACHERS: value})
    assert settings is not None
    return settings.teachers


def test_an_entrys_tp_option_is_read():
    assert _teachers("/ckpt/a;tp=2,/ckpt/b") == (Teacher("/ckpt/a", tp=2), Teacher("/ckpt/b"))
    assert _teachers("/ckpt/a; tp = 4 ;pp=1;ep=1")[0].tp == 4  # ep of 1: the only expert size served
    assert _teachers("/ckpt/a;tp=2;pp=2,/ckpt/b;pp=4") == (Teacher("/ckpt/a", tp=2, pp=2), Teacher("/ckpt/b", pp=4))
    assert [(t.at_layout, t.layout_written) for t in _teachers("/ckpt/a;pp=2,/ckpt/b")] == [(True, "pp=2"), (False, "")]


@pytest.mark.parametrize(("entry", "words"), [
    ("/ckpt/a;tp=0", "option 'tp=0' must be a positive integer"),
    ("/ckpt/a;tp=-2", "option 'tp=-2' must be a positive integer"),
    ("/ckpt/a;tp=two", "option 'tp=two' must be a positive integer"),
    ("/ckpt/a;tp=", "option 'tp=' must be a positive integer"),
    ("/ckpt/a;tp=2;tp=4", "option 'tp' given twice"),
    ("/ckpt/a;pp=0", "option 'pp=0' must be a positive integer"),
    ("/ckpt/a;pp=2;pp=2", "option 'pp' given twice"),
    ("/ckpt/a;ep=4", "option 'ep=4': a teacher's own expert-parallel size is not served yet"),
    ("/ckpt/a@m:f;tp=2", "a provider's model '@module:function' is not served at its own layout yet"),
    ("/ckpt/a;dp=2", "unknown option 'dp=2'.*';tp=N'"),
])
def test_a_bad_tp_option_is_refused_naming_the_entry(entry, words):
    with pytest.raises(ValueError, match=f"{TEACHERS} entry '{entry}'.*{words}" if "*" not in words else words):
        opd_settings({TEACHERS: entry})


def test_a_teacher_with_another_tokenizer_takes_a_layout():
    (teacher,) = opd_settings({TEACHERS: "/ckpt/a;tokenizer=own;tp=2;pp=2"}).teachers
    assert teacher.own_tokenizer and (teacher.tp, teacher.pp) == (2, 2) and teacher.at_layout


def test_a_roles_tp_option_is_read_and_checked():
    value = "prm_teacher;tp=2,teacher:resident;tp=4,ref:swap"
    assert env.checked_role_names({env.INFERENCE_ROLES: value}) == ["prm_teacher", "teacher", "ref"]
    assert env.role_layouts({env.INFERENCE_ROLES: value}) == {"prm_teacher": 2, "teacher": 4}
    assert env.role_residencies({env.INFERENCE_ROLES: value}) == {"teacher": "resident", "ref": "swap"}
    for bad, words in (("teacher;tp=0", "option 'tp=0' must be a positive integer"),
                       ("teacher;tp=2;tp=2", "option 'tp' given twice"),
                       ("teacher;pp=2", "option 'pp=2': a role's model at its own pipeline-parallel size is not "
                                        "served"),
                       ("teacher;bf16", "unknown option 'bf16'"),
                       ("teacher:fast;tp=2", "has residency 'fast'")):
        with pytest.raises(ValueError, match=words if "residency" in words else
                           f"{env.INFERENCE_ROLES} role '{bad}': {words}"):
            env.checked_role_names({env.INFERENCE_ROLES: bad})
        assert words.split(":")[0] in env.summary({env.INFERENCE_ROLES: bad})["errors"][0]
    # any residency at a role's own layout (the 2-rank world builds `prm_teacher:stream;tp=2`: test_slime_role_layout)
    served = "judge:stream;tp=2,ref:swap;tp=2"
    assert env.checked_role_names({env.INFERENCE_ROLES: served}) == ["judge", "ref"]
    assert env.role_layouts({env.INFERENCE_ROLES: served}) == {"judge": 2, "ref": 2}
    assert env.role_residencies({env.INFERENCE_ROLES: served}) == {"judge": "stream", "ref": "swap"}


@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    """A Hugging Face teacher of another shape than _Actor (2 layers) and one of its shape (3)."""
    other, same = tmp_path / "other", tmp_path / "same"
    write_tiny_checkpoint(other, tiny_hf_config("qwen3"))
    write_tiny_checkpoint(same, tiny_hf_config("qwen3", num_hidden_layers=3))
    built: list = []
    monkeypatch.setattr(hf_teachers, "build_hf_teacher", lambda *a, **k: built.append((a, k)) or ["chunk"])
    monkeypatch.setattr(layout_teacher, "student_sizes", lambda: {"pipeline": 1, "context": 1})
    monkeypatch.setattr(layout_teacher, "process_group_collection_class", lambda: object)
    return SimpleNamespace(other=other, same=same, built=built)


@pytest.mark.parametrize(("entries", "extra", "words"), [
    ("{other};tp=2", {}, r"';tp=2' cannot be laid over 1 rank\(s\): the world size must be a multiple"),
    ("{other};pp=2", {}, r"other;pp=2': ';pp=2' cannot be laid over 1 rank\(s\): the world size must be a multiple "
                         r"of the teacher's tp x pp = 2"),
    ("{other},{same};tp=1", {}, "this checkpoint goes slime's snapshot route.*drop ';tp='"),
    ("{other};tp=1", {"MEGATRON_RL_PATCHES_OPD_IDS_FROM": "union"},
     "a teacher at its own layout scores the student's ids only"),
    ("{other};tp=1,{other}", {"MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher"},
     "first with MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher: a teacher at its own layout scores given ids only"),
])
def test_a_layout_the_run_cannot_serve_is_refused_before_any_teacher_loads(checkpoints, entries, extra, words):
    actor = TinyActor(num_layers=3)
    settings = opd_settings({TEACHERS: entries.format(other=checkpoints.other, same=checkpoints.same), **extra})
    with pytest.raises(ValueError, match=words):
        slime_opd.load_teachers(actor, settings)
    assert checkpoints.built == [] and actor.loaded == []  # nothing loaded, not even the teachers before it


@pytest.mark.parametrize("mode", ["swap", "stream"])
def test_a_layout_teacher_is_built_at_the_runs_residency(checkpoints, mode):
    """MEGATRON_RL_PATCHES_OPD_RESIDENCY reaches a `;tp=` / `;pp=` teacher's build (the 2-rank world
    scores `PATH;tp=2` streamed and `PATH;pp=2` swapped: test_slime_opd_layout_teacher.py)."""
    settings = opd_settings({TEACHERS: f"{checkpoints.other};tp=1,{checkpoints.other};pp=1",
                             "MEGATRON_RL_PATCHES_OPD_RESIDENCY": mode})
    slime_opd.load_teachers(TinyActor(num_layers=3), settings)
    assert [(args[2], kwargs["layout"]) for args, kwargs in checkpoints.built] == [(mode, TeacherLayout(tp=1))] * 2


def test_a_student_with_pipeline_or_context_parallelism_is_not_refused(checkpoints, monkeypatch):
    """Served (the 2-rank world: test_slime_opd_layout_teacher.py); here only that the settings
    check lets them through to the build (one rank: a tp=1 teacher)."""
    monkeypatch.setattr(layout_teacher, "process_group_collection_class", lambda: object)  # 0.13.1 refuses it
    for sizes in ({"pipeline": 2, "context": 1}, {"pipeline": 1, "context": 2}):
        monkeypatch.setattr(layout_teacher, "student_sizes", lambda sizes=sizes: sizes)
        layout_teacher.check_layout_teachers(opd_settings({TEACHERS: f"{checkpoints.other};tp=1"}), ["hf"],
                                             "snapshot")


def test_a_role_at_a_layout_it_cannot_serve_is_refused_by_name_before_it_loads(checkpoints, monkeypatch):
    """`role;tp=N`: served for a Hugging Face directory of another architecture (the 2-rank world:
    test_slime_role_layout.py); refused by name otherwise, nothing built."""
    actor = TinyActor(num_layers=3).args
    entry = f"{env.INFERENCE_ROLES} role 'prm_teacher;tp="
    with pytest.raises(ValueError, match=rf"{entry}2': ';tp=2' cannot be laid over 1 rank\(s\)"):
        check_role_layout(actor, "prm_teacher", 2, str(checkpoints.other), None)
    with pytest.raises(ValueError, match=f"{entry}1': its weights .* go slime's own route .*drop ';tp='"):
        check_role_layout(actor, "prm_teacher", 1, str(checkpoints.same), None)  # the actor's architecture
    with pytest.raises(ValueError, match=r"go slime's own route.*args.prm_teacher_ckpt_step names a Megatron"):
        check_role_layout(actor, "prm_teacher", 1, str(checkpoints.other), 7)
    check_role_layout(actor, "prm_teacher", 1, str(checkpoints.other), None)  # served
    monkeypatch.setattr(layout_teacher, "student_sizes", lambda: {"pipeline": 2, "context": 1})
    words = "a role at its own layout is served beside a student without it yet"
    with pytest.raises(ValueError, match=f"{entry}1': the student runs with pipeline parallelism .*{words}"):
        check_role_layout(actor, "prm_teacher", 1, str(checkpoints.other), None)
    assert checkpoints.built == []
