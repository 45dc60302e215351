"""Issue 96 item 8: an entry's numbers and its quoted pieces are bounded. `;vocab=` of 5,000 digits
is refused naming the entry and the option (slime's parser, verl's, doctor) where Python's int()
raised its bare "Exceeds the limit (4300 digits)"; a megabyte option, entry or engine name is
quoted as a bounded piece with its length, not whole."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.integrations.verl.entry import parse_entry as verl_entry
from megatron_rl_patches.teachers.kinds import parse_entries

TEACHERS, VERL_TEACHER = "MEGATRON_RL_PATCHES_OPD_TEACHERS", "MEGATRON_RL_PATCHES_VERL_TEACHER"
URL = "http://127.0.0.1:9"
DIGITS = "9" * 5000
MEGABYTE = 1_000_000
BOUND = 2_000  # a refusal's length, whatever it quotes


def test_slimes_parser_names_a_vocab_of_5000_digits():
    with pytest.raises(ValueError, match=rf"{TEACHERS} entry '{URL};.*option 'vocab=9+'.*characters\) must be "
                                         r"';vocab=N', the served model's vocabulary size") as refused:
        parse_entries(f"{URL};engine=vllm;same_tokenizer;vocab={DIGITS}")
    assert "Exceeds the limit" not in str(refused.value) and len(str(refused.value)) < BOUND


def test_verls_parser_names_a_vocab_of_5000_digits():
    with pytest.raises(ValueError, match=rf"{VERL_TEACHER}='{URL};.*option 'vocab=9+'.* must be ';vocab=N'") as refused:
        verl_entry(f"{URL};engine=vllm;vocab={DIGITS}")
    assert "Exceeds the limit" not in str(refused.value) and len(str(refused.value)) < BOUND


@pytest.mark.parametrize("variable", [TEACHERS, VERL_TEACHER])
def test_doctor_names_a_vocab_of_5000_digits(clean_patch_state, capsys, variable):
    clean_patch_state.setenv(variable, f"{URL};engine=vllm;same_tokenizer;vocab={DIGITS}")
    code = cli.main(["doctor", "--json"])
    out = capsys.readouterr().out
    problems = json.loads(out)["problems"]
    assert code == cli.PROBLEM and not [p for p in problems if "Exceeds the limit" in p], problems
    (problem,) = [p for p in problems if p.startswith(variable)]
    assert "option 'vocab=9" in problem and "must be ';vocab=N'" in problem and len(problem) < BOUND, problem


@pytest.mark.parametrize("option", ["vocab=" + "9" * MEGABYTE, "colour=" + "x" * MEGABYTE, "engine=" + "x" * MEGABYTE,
                                    "tp=" + "1" * MEGABYTE])
def test_a_megabyte_option_is_quoted_as_a_bounded_piece(option):
    engine = "" if option.startswith("engine=") else ";engine=vllm"
    for parse, said in ((parse_entries, f"{TEACHERS} entry"), (verl_entry, f"{VERL_TEACHER}=")):
        with pytest.raises(ValueError, match=said) as refused:
            parse(f"{URL}{engine};{option}")
        assert len(str(refused.value)) < BOUND and " characters)" in str(refused.value), str(refused.value)[:300]


def test_a_megabyte_path_entry_and_the_live_self_teacher_are_quoted_bounded():
    for entry in ("/ckpt/" + "x" * MEGABYTE + ";colour=red", "student;context=k;" + "x" * MEGABYTE):
        with pytest.raises(ValueError, match=f"{TEACHERS} entry") as refused:
            parse_entries(entry)
        assert len(str(refused.value)) < BOUND, str(refused.value)[:300]


def test_doctor_names_a_teacher_path_too_long_to_look_at(clean_patch_state, capsys):
    """A 5,000-character checkpoint path: Path.exists raises ENAMETOOLONG (no FileNotFoundError);
    the checkpoint kind says the path cannot be looked at, where doctor crashed with an OSError."""
    clean_patch_state.setenv(TEACHERS, "/tmp/" + "t" * 5000)
    code = cli.main(["doctor", "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert code != 0 and any("teacher '/tmp/ttt" in problem and "cannot be looked at on this machine" in problem
                             for problem in problems), problems
