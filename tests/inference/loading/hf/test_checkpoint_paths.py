"""What every entry point takes as a Hugging Face checkpoint (issue 55 item 5): its directory. The
hub cache folder (`models--ORG--NAME`: snapshots/<rev>/, refs/main, blobs/) is refused naming the
snapshot to pass (refs/main's first), and the config.json file itself naming its directory, by the
builder, `check_teacher_vocab`, `memory --hf`, slime's route and `doctor` alike; `doctor` also names
a `;tokenizer=own` teacher without its tokenizer.json. Nothing is built, the files stay as they were."""
from __future__ import annotations

from argparse import Namespace

import pytest

from megatron_rl_patches import build_inference_model_from_hf
from megatron_rl_patches.apps.cli import main
from megatron_rl_patches.inference.loading.hf import check_teacher_vocab
from megatron_rl_patches.integrations.megatron.opd import hf_teachers
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

REVISION, OLD = "0123abcd", "fedc9876"


@pytest.fixture
def hub_cache(tmp_path):
    """A hub cache folder holding two revisions, refs/main naming the newer."""
    root = tmp_path / "hub" / "models--org--tiny"
    for revision in (OLD, REVISION):
        write_tiny_checkpoint(root / "snapshots" / revision, tiny_hf_config("qwen3"))
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    return root


def _every_entry_point(path, capsys):
    """The error each entry point gives for `path`: (builder, check_teacher_vocab, memory --hf, slime)."""
    errors = []
    for call in (lambda: build_inference_model_from_hf(path), lambda: check_teacher_vocab(path, 1001)):
        with pytest.raises(ValueError) as caught:
            call()
        errors.append(str(caught.value))
    assert main(["memory", "--hf", str(path)]) == 2
    errors.append(capsys.readouterr().err)
    with pytest.raises(ValueError) as caught:
        hf_teachers.local_loading(str(path), Namespace(), f"{TEACHERS}: teacher {str(path)!r}")
    errors.append(str(caught.value))
    return errors


def test_a_hub_cache_folder_is_refused_naming_its_snapshot(no_build, hub_cache, clean_patch_state, capsys):
    from megatron_rl_patches.apps.cli.doctor import teacher_problems

    snapshot = hub_cache / "snapshots" / REVISION
    for error in _every_entry_point(hub_cache, capsys):
        assert "is a Hugging Face hub cache folder (models--ORG--NAME), not a checkpoint directory; pass its " \
               f"snapshot directory {str(snapshot)!r} (refs/main's; the others: " in error, error
    clean_patch_state.setenv(TEACHERS, str(hub_cache))
    (problem,) = teacher_problems()
    assert problem.startswith(f"{TEACHERS}: teacher {str(hub_cache)!r} is a Hugging Face hub cache folder")
    assert repr(str(snapshot)) in problem
    clean_patch_state.setenv(TEACHERS, str(snapshot))  # what it says to pass: served
    assert teacher_problems() == []
    assert check_teacher_vocab(snapshot, 1001) == 1001


def test_the_config_json_file_is_refused_naming_its_directory(no_build, tmp_path, clean_patch_state, capsys):
    from megatron_rl_patches.apps.cli.doctor import teacher_problems

    write_tiny_checkpoint(tmp_path / "ckpt", tiny_hf_config("qwen3"))
    file = tmp_path / "ckpt" / "config.json"
    before = file.read_bytes()
    # memory --hf too (issue 72 item 7: it planned the file); a config saved under another name it plans
    # (test_memory_hf_config_file.py, issue 63 item 9). slime's message: test_slime_hf_teachers.py
    for error in _every_entry_point(file, capsys)[:3]:
        assert f"{str(file)!r} is a file; pass the checkpoint directory that holds it as config.json " \
               f"({str(file.parent)!r} if it is that)" in error, error
    clean_patch_state.setenv(TEACHERS, str(file))
    assert teacher_problems() == [f"{TEACHERS}: teacher {str(file)!r} is a file of a Hugging Face checkpoint; "
                                  f"name its directory {str(file.parent)!r}"]
    assert file.read_bytes() == before


def test_doctor_names_an_own_tokenizer_teacher_without_its_tokenizer(tmp_path, clean_patch_state):
    from megatron_rl_patches.apps.cli.doctor import teacher_problems

    teacher = tmp_path / "teacher"
    write_tiny_checkpoint(teacher, tiny_hf_config("qwen3"))
    clean_patch_state.setenv(TEACHERS, f"{teacher};tokenizer=own")
    (problem,) = teacher_problems()
    assert problem == (f"{TEACHERS}: teacher {str(teacher)!r} asks ';tokenizer=own' but "
                       f"{str(teacher / 'tokenizer.json')!r} does not exist: the teacher's own tokenizer is read "
                       "from it; put the model's tokenizer.json there (e.g. `hf download ORG/NAME tokenizer.json "
                       f"--local-dir {teacher}`)")
    (teacher / "tokenizer.json").write_text("{}")
    assert teacher_problems() == []
