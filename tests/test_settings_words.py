"""The settings' parsers read back whole (docs/testing.md, mutation testing of settings.py): each
switch's refusal with the words it takes and what each side does, a known backend taken, the
smallest layout size taken and the unserved one refused whole, a role that is no identifier and a
residency no build takes refused whole, the residency check, and `read_settings`' reading of a
group read as one (its value under each variable set, a refusal naming no variable put on the first
one set)."""
from __future__ import annotations

import sys

import pytest

from megatron_rl_patches import settings

SWITCHES = {
    settings.strict_setting: ("MEGATRON_RL_PATCHES_STRICT", "patch problems raise", "they warn"),
    settings.allow_untested_setting: ("MEGATRON_RL_PATCHES_ALLOW_UNTESTED", "apply patches outside their supported "
                                      "range", "skip them there"),
    settings.invariant_setting: ("MEGATRON_RL_PATCHES_INVARIANT", "invariant vocabulary ops", "the default mode"),
    settings.native_setting: ("MEGATRON_RL_PATCHES_NATIVE", "the compiled kernel", "the torch tiles"),
    settings.shared_prefix_setting: ("MEGATRON_RL_PATCHES_SHARED_PREFIX", "pack by shared prefix",
                                     "each sample whole"),
}


def _words(call, *args) -> str:
    with pytest.raises(ValueError) as refused:
        call(*args)
    return str(refused.value)


@pytest.mark.parametrize("parse", list(SWITCHES), ids=lambda parse: parse.__name__)
def test_a_switchs_refusal_names_every_word_and_what_each_side_does(parse):
    name, on, off = SWITCHES[parse]
    assert _words(parse, "2") == (f"{name}='2' is not a switch: use 1/true/yes/on ({on}) or 0/false/no/off ({off}), "
                                  "or leave it unset")


def test_verl_rows_refusal_is_whole():
    assert _words(settings.verl_rows_setting, "some") == (
        "MEGATRON_RL_PATCHES_VERL_ROWS='some' is not a row choice: use all (every row), or leave it unset for the "
        "rows verl reads")


def test_a_known_backend_is_taken_trimmed_and_lower_cased():
    assert settings.parse_backend("torch") == "torch"
    assert settings.parse_backend(" Triton ") == "triton"
    assert settings.parse_backend("mine", ("torch", "mine")) == "mine"
    assert settings.parse_backend(None) == settings.parse_backend("") == settings.parse_backend("AUTO") == "auto"


def test_the_smallest_layout_size_is_taken_and_an_expert_size_refused_whole():
    assert settings.layout_size("tp=1", "here") == ("tp", 1)
    assert settings.layout_size(" pp = 2 ", "here") == ("pp", 2)
    assert settings.layout_size("ep=1", "here") == ("ep", 1)
    assert _words(settings.layout_size, "ep=2", "here") == (
        "here: option 'ep=2': a teacher's own expert-parallel size is not served yet (tensor and pipeline "
        "parallelism are: ';tp=N;pp=M'); drop it or use 1")


def test_a_role_that_is_no_identifier_or_has_no_residency_a_build_takes_is_refused_whole():
    assert _words(settings.roles_setting, "ref,1judge") == (
        "MEGATRON_RL_PATCHES_INFERENCE_ROLES='ref,1judge': '1judge' is not a role name; role names are identifiers "
        "(letters, digits, '_'), comma-separated")
    assert _words(settings.roles_setting, "ref:cold") == (
        "MEGATRON_RL_PATCHES_INFERENCE_ROLES='ref:cold': role 'ref' has residency 'cold'; use "
        "role:resident|swap|stream (e.g. ref:stream), or the role alone for resident")
    assert settings.roles_setting("ref:stream,judge") == ("ref", "judge")


def test_a_residency_is_one_of_the_modes():
    assert [settings.check_residency(mode) for mode in ("resident", "swap", "stream")] == ["resident", "swap", "stream"]
    assert _words(settings.check_residency, "cold", "the teacher's residency") == (
        "the teacher's residency must be one of 'resident', 'swap', 'stream', got 'cold'")
    assert _words(settings.check_residency, None) == "residency must be one of 'resident', 'swap', 'stream', got None"


FIRST, SECOND = "MEGATRON_RL_PATCHES_TEST_FIRST", "MEGATRON_RL_PATCHES_TEST_SECOND"


def read_as_one(env):
    """A group's parser (of the whole environment): a refusal that names no variable for 'bad'."""
    if env.get(FIRST) == "bad" or env.get(SECOND) == "bad":
        raise ValueError("the pair is not a pair")
    return (env.get(FIRST), env.get(SECOND))


def test_a_group_read_as_one_gives_its_value_to_each_variable_set_and_its_refusal_to_the_first_set(monkeypatch):
    reference = f"{__name__}:read_as_one"
    assert sys.modules[__name__].read_as_one is read_as_one
    for name in (FIRST, SECOND):
        monkeypatch.setitem(settings.SETTINGS, name, settings.Setting("a test pair", reference, together=True))
    read = settings.read_settings({FIRST: "a"}, (FIRST, SECOND))
    assert read.values == {FIRST: ("a", None), SECOND: None} and read.refusals == {}
    read = settings.read_settings({SECOND: "b"}, (FIRST, SECOND))
    assert read.values == {FIRST: None, SECOND: (None, "b")} and read.refusals == {}
    read = settings.read_settings({SECOND: "bad", FIRST: "a"}, (FIRST, SECOND))
    assert read.refusals == {FIRST: "the pair is not a pair"}  # names no variable: the group's first one set
    assert read.values == {FIRST: None, SECOND: None}
    read = settings.read_settings({SECOND: "bad"}, (FIRST, SECOND))
    assert read.refusals == {SECOND: "the pair is not a pair"}


def test_a_roles_own_pipeline_and_a_non_string_value_are_refused_whole():
    assert _words(settings.roles_setting, "judge;pp=2") == (
        "MEGATRON_RL_PATCHES_INFERENCE_ROLES role 'judge;pp=2': option 'pp=2': a role's model at its own "
        "pipeline-parallel size is not served yet (a role at its own layout takes ';tp=N'; an own pipeline is "
        "served for MEGATRON_RL_PATCHES_OPD_TEACHERS entries 'PATH;pp=N'); drop it or use 1")
    with pytest.raises(TypeError) as refused:
        settings.text({"MEGATRON_RL_PATCHES_STRICT": 5}, "MEGATRON_RL_PATCHES_STRICT")  # type: ignore[dict-item]
    assert str(refused.value) == ("environ['MEGATRON_RL_PATCHES_STRICT'] must be a string (environment values are), "
                                  "got int 5")


def test_the_cache_root_and_tritons_interpreter_switch(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert settings.cache_root() == str(tmp_path / ".cache")
    monkeypatch.setenv("XDG_CACHE_HOME", "/elsewhere")
    assert settings.cache_root() == "/elsewhere"
    for value, interpreted in (("1", True), (" Y ", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert settings.triton_interpreted() is interpreted, value
