"""The packages' lazy export tables: one reader (`_lazy.lazy_names`) of `module: Name ...` lines."""
import pytest

from megatron_rl_patches._lazy import lazy_names


def test_lines_map_each_name_to_its_module_in_order():
    table = lazy_names("""
        scores: TeacherScores
        # a comment: not a module
        megatron_rl_patches.teachers.served.client: ServedTeacher
            PendingScores
    """)
    assert list(table.items()) == [("TeacherScores", "scores"),
                                   ("ServedTeacher", "megatron_rl_patches.teachers.served.client"),
                                   ("PendingScores", "megatron_rl_patches.teachers.served.client")]


def test_a_name_under_two_modules_is_refused():
    with pytest.raises(ValueError, match=r"'align' is listed under both 'alignment' and 'losses'"):
        lazy_names("alignment: align\nlosses: align")


def test_names_before_any_module_are_refused():
    with pytest.raises(ValueError, match="names no module"):
        lazy_names("Alignment align")


def test_a_renamed_public_name_warns_once_and_gives_the_new_one():
    """Issue 113: a public name renamed to say its kind keeps its old name for a release."""
    from megatron_rl_patches import cross_tokenizer
    from megatron_rl_patches.cross_tokenizer.teacher_passes import PassBatches, pass_batches

    cross_tokenizer.__dict__.pop("PassPlan", None)
    with pytest.warns(DeprecationWarning, match=r"cross_tokenizer\.PassPlan is now PassBatches"):
        assert cross_tokenizer.PassPlan is PassBatches
    assert cross_tokenizer.PassPlan is PassBatches  # cached: no second warning
    with pytest.warns(DeprecationWarning, match="plan_passes is now pass_batches"):
        assert cross_tokenizer.plan_passes is pass_batches
    assert "PassPlan" not in cross_tokenizer.__all__
