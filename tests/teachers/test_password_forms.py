"""A password holding what splits an entry (',' between entries, '|' between replicas, ';' before
options, white space around it) or what ends a URL's userinfo ('@') is refused wherever a URL can
arrive — the constructor (NeMo-RL's policy too), a list element, a comma-separated setting, verl's variable, doctor —
with an error naming the argument or variable, and no piece of it (the user name, any three
characters of the password) in the error, the warnings, the log or doctor's text and JSON."""
from __future__ import annotations

import asyncio
import json
import logging
import types
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from kit.ports import refused_port

TEACHERS, VERL_TEACHER = "MEGATRON_RL_PATCHES_OPD_TEACHERS", "MEGATRON_RL_PATCHES_VERL_TEACHER"
OPD_K = "MEGATRON_RL_PATCHES_OPD_K"
USER = "bob"
PASSWORDS = ["hunt,er2pw", "hunt er2pw", "hunt\ter2pw", "hunt\ner2pw", "hunt;er2pw", "hunt|er2pw", "hunt%2Cer2pw",
             "hunt@er2pw"]


def pieces(password: str) -> set[str]:
    """Every piece of the password three characters or longer, and the user name."""
    return {password[i:j] for i in range(len(password)) for j in range(i + 3, len(password) + 1)} | {USER}


def strings(value: Any) -> list[str]:
    """Every string inside a JSON-ready value (keys included)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for key, item in value.items() for s in strings(key) + strings(item)]
    if isinstance(value, (list, tuple)):
        return [s for item in value for s in strings(item)]
    return []


def served_teacher(url: str, env: Any) -> str:
    from megatron_rl_patches.teachers import ClientSettings, ServedTeacher

    with pytest.raises(ValueError, match=r"url .*carries a user or password") as refused:
        ServedTeacher(url, top_k=2, client=ClientSettings(retries=0)).check()
    return str(refused.value)


def nemo_rl_policy(url: str, env: Any) -> str:
    from megatron_rl_patches.integrations.nemo_rl.served_teacher import served_teacher_policy

    with pytest.raises(ValueError, match=r"url .*carries a user or password") as refused:
        served_teacher_policy(url, top_k=2)
    return str(refused.value)


def build_list(url: str, env: Any, option: str = "") -> str:
    from megatron_rl_patches.teachers import build_teachers, local_host

    with pytest.raises(ValueError, match=r"build_teachers\(entries=\.\.\.\).*carries a user or password") as refused:
        build_teachers([f"{url};engine=vllm{option}"], local_host(50), top_k=2)
    return str(refused.value)


def build_list_head(url: str, env: Any) -> str:
    return build_list(url, env, ";head=/nonexistent/head")


def build_string(url: str, env: Any) -> str:
    from megatron_rl_patches.teachers import build_teachers, local_host

    with pytest.raises(ValueError, match=r"build_teachers\(entries=\.\.\.\).*carries a user or password") as refused:
        build_teachers(f"http://127.0.0.1:1;engine=vllm,{url};engine=vllm", local_host(50), top_k=2)
    return str(refused.value)


def opd_settings(url: str, env: Any, extra: dict[str, str] | None = None, option: str = "") -> str:
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings

    with pytest.raises(ValueError, match=rf"{TEACHERS}.*carries a user or password") as refused:
        opd_settings({TEACHERS: f"/ckpt/a,{url};engine=vllm{option}", **(extra or {})})
    return str(refused.value)


def opd_settings_vocab(url: str, env: Any) -> str:
    return opd_settings(url, env, {OPD_K: "vocab"}, ";head=/nonexistent/head")


def slime_check(url: str, env: Any) -> str:
    from megatron_rl_patches.integrations import check_settings

    env.setenv(TEACHERS, f"{url};engine=vllm;head=/nonexistent/head")
    env.setenv(OPD_K, "vocab")
    with pytest.raises(ValueError, match=rf"{TEACHERS}.*carries a user or password") as refused:
        check_settings()
    return str(refused.value)


def verl_entry(url: str, env: Any) -> str:
    from megatron_rl_patches.integrations.verl.entry import parse_entry

    with pytest.raises(ValueError, match=rf"{VERL_TEACHER}.*carries a user or password") as refused:
        parse_entry(f"{url};engine=vllm")
    return str(refused.value)


def verl_client(url: str, env: Any) -> str:
    """verl's teacher-loop client answered through the patch's wrapper: its warning and its error."""
    from megatron_rl_patches.integrations.verl.served import compute_teacher_logprobs_single_wrapper

    async def compute_teacher_logprobs_single(sequence_ids, multi_modal_data=None):
        raise AssertionError("verl's own replicas asked")

    manager = SimpleNamespace(teacher_model_configs={"teacher": None},
                              distillation_loss_config=SimpleNamespace(topk=2, loss_settings=SimpleNamespace(
                                  use_topk=True)))
    env.setenv(VERL_TEACHER, f"{url};engine=vllm")
    with pytest.raises(ValueError, match=rf"{VERL_TEACHER}.*carries a user or password") as refused:
        asyncio.run(compute_teacher_logprobs_single_wrapper(compute_teacher_logprobs_single, manager,
                                                            ([1, 2, 3],), {}))
    return str(refused.value)


def verl_self_teacher(url: str, env: Any) -> str:
    """verl's live self-teacher entry with a URL where its tokenizer goes (issue 86 item 8), read where
    verl's trainer reads it."""
    from megatron_rl_patches.integrations.verl.entry import verl_teacher

    env.setenv(VERL_TEACHER, f"student;context=hint;tokenizer={url}/t")
    with pytest.raises(ValueError, match=rf"{VERL_TEACHER}.*carries a user or password") as refused:
        verl_teacher(types.SimpleNamespace())  # read at a door: refused there
    return str(refused.value)


def verl_self_teacher_unread(url: str, env: Any) -> str:
    """The same without its context (an entry refused for another reason too): the password is
    refused first, never quoted in the other refusal (issue 86 item 8)."""
    from megatron_rl_patches.integrations.verl.entry import verl_teacher

    env.setenv(VERL_TEACHER, f"student;tokenizer={url}/t")
    with pytest.raises(ValueError, match=rf"{VERL_TEACHER}.*carries a user or password") as refused:
        verl_teacher(types.SimpleNamespace())  # read at a door: refused there
    return str(refused.value)


def verl_trainer(url: str, env: Any) -> str:
    from megatron_rl_patches.integrations.verl.entry import verl_teacher

    env.setenv(VERL_TEACHER, f"{url};engine=vllm;head=/nonexistent/head")
    with pytest.raises(ValueError, match=rf"{VERL_TEACHER}.*carries a user or password") as refused:
        verl_teacher(types.SimpleNamespace())  # the engine's door
    return str(refused.value)


def doctor_text(variable: str, value: Callable[[str], str], env: Any, capsys: Any, url: str) -> str:
    """What `doctor` and `doctor --json` print (every string of the JSON object) with the variable set."""
    from megatron_rl_patches.apps.cli import main

    env.setenv(variable, value(url))
    shown = []
    for argv in (["doctor", "--json"], ["doctor"]):
        main(argv)
        out, err = capsys.readouterr()
        shown += [*strings(json.loads(out)), err] if "--json" in argv else [out, err]
    text = "\n".join(shown)
    assert "carries a user or password" in text, text[-2000:]
    return text


ENTRY_POINTS: dict[str, Callable[..., str]] = {
    "ServedTeacher": served_teacher,
    "nemo_rl_served_teacher_policy": nemo_rl_policy,
    "build_teachers_list": build_list,
    "build_teachers_list_head": build_list_head,
    "build_teachers_string": build_string,
    "opd_settings": opd_settings,
    "opd_settings_vocab": opd_settings_vocab,
    "slime_check_settings": slime_check,
    "verl_parse_entry": verl_entry,
    "verl_client": verl_client,
    "verl_trainer": verl_trainer,
    "verl_self_teacher": verl_self_teacher,
    "verl_self_teacher_unread": verl_self_teacher_unread,
}
DOCTOR: dict[str, tuple[str, Callable[[str], str]]] = {
    "doctor_opd": (TEACHERS, lambda url: f"/ckpt/a,{url};engine=vllm"),
    "doctor_opd_vocab": (TEACHERS, lambda url: f"{url};engine=vllm;head=/nonexistent/head"),
    "doctor_verl": (VERL_TEACHER, lambda url: f"{url};engine=vllm"),
    "doctor_verl_self_teacher": (VERL_TEACHER, lambda url: f"student;context=hint;tokenizer={url}/t"),
}


@pytest.fixture
def shown(clean_patch_state, caplog, recwarn):
    """Everything a call showed: its error text, then the log's records and the warnings since the
    last call."""
    caplog.set_level(logging.DEBUG)

    def seen(error: str) -> str:
        text = "\n".join([error, caplog.text, *(r.getMessage() for r in caplog.records),
                          *(str(w.message) for w in recwarn)])
        caplog.clear()
        recwarn.clear()
        return text

    return seen


def decoy(password: str) -> str:
    """A password of the same shape (its separators kept) sharing no letter or digit with it."""
    return password.translate(str.maketrans("hunter2pwC", "QJXGZVKYMW"))


@pytest.mark.parametrize("password", PASSWORDS)
@pytest.mark.parametrize("where", list(ENTRY_POINTS) + list(DOCTOR))
def test_a_password_in_any_form_is_refused_by_name_and_never_shown(where, password, shown, clean_patch_state,
                                                                   capsys):
    """Shown against a decoy of the same shape: a piece of the password counts where it is shown
    more often than with the decoy (the messages' own words hold "nt " and "count")."""
    pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    texts = []
    with refused_port() as port:  # nothing answers there, for the whole test
        for user, secret in (("zed", decoy(password)), (USER, password)):
            url = f"http://{user}:{secret}@127.0.0.1:{port}"
            if where in DOCTOR:
                variable, value = DOCTOR[where]
                texts.append(shown(doctor_text(variable, value, clean_patch_state, capsys, url)))
            else:
                texts.append(shown(ENTRY_POINTS[where](url, clean_patch_state)))
    without, text = texts
    leaked = sorted(piece for piece in pieces(password) if text.count(piece) > without.count(piece))
    assert not leaked, (leaked, text[-3000:])


@pytest.mark.parametrize("entry", ["http://127.0.0.1:8000;engine=vllm;head=/models/qwen@v2",
                                   "http://127.0.0.1:8000;head=/models/qwen@v2;engine=vllm",
                                   "http://[::1]:8000;engine=vllm;tokenizer=/tok@main"])
def test_an_at_sign_in_an_option_value_is_no_password(entry):
    """Only the URL's authority holds a user or password: an '@' in a head's or tokenizer's path
    is the path's."""
    from megatron_rl_patches.integrations.verl.entry import parse_entry as verl_entry
    from megatron_rl_patches.teachers.kinds import parse_entries, parse_entry
    from megatron_rl_patches.teachers.redaction import has_userinfo, redacted

    assert not has_userinfo(entry) and redacted(entry) == entry
    read = parse_entry(entry)
    assert read.path == entry.split(";")[0] and "@" in (read.head or read.tokenizer or "")
    assert parse_entries(f"{entry},/ckpt/b") == (read, parse_entry("/ckpt/b"))
    if "tokenizer" not in entry:
        assert verl_entry(entry).head == "/models/qwen@v2"


@pytest.mark.parametrize(("text", "shown"), [
    # a password of digits before a separator: its authority looks like host:port
    ("http://bob:1234,5678@h:8000;engine=vllm", "http://***@h:8000;engine=vllm"),
    ("http://bob:1234;56@h:8000;engine=vllm", "http://***@h:8000;engine=vllm"),
    ("http://bob:12 34@h:8000", "http://***@h:8000"),
    # an '@' in a later entry's path is no password of this URL
    ("http://h:8000;engine=vllm,/ckpt/a@models:provider", "http://h:8000;engine=vllm,/ckpt/a@models:provider"),
    ("http://h:8000,/ckpt/a@models:provider", "http://h:8000,/ckpt/a@models:provider"),
    # replicas joined by '|': each URL's own
    ("http://a:8000|http://bob:hunt|er2pw@b:8000;engine=vllm", "http://a:8000|http://***@b:8000;engine=vllm"),
    ("http://bob:x://y@h:1", "http://***@h:1"),
])
def test_redaction_reads_where_a_password_can_end(text, shown):
    from megatron_rl_patches.teachers.redaction import has_userinfo, redacted

    assert redacted(text) == shown and has_userinfo(text) == (shown != text)
