"""The teachers' kinds as one table (`teachers.kinds`): each entry of MEGATRON_RL_PATCHES_OPD_TEACHERS
read by the first kind that recognizes it — a URL before anything splits it on ';', '@' or ':',
then a provider's '@', then a path — mixable in one setting; a served entry's refusals by name
(a user or password in the URL, never echoed; SGLang; no engine; options it does not take), and
the table itself (rows named once, the path row last) loaded without torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl_patches.teachers.entry import CHECKPOINT, PROVIDER, SERVED, TeacherEntry
from megatron_rl_patches.teachers.kinds import KINDS, REGISTRY, RunFacts, check_entries, parse_entries, parse_entry
from megatron_rl_patches.teachers.kinds.student import STUDENT

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"


@pytest.mark.parametrize(("entry", "want"), [
    ("http://localhost:8000;engine=vllm", TeacherEntry("http://localhost:8000", kind=SERVED, engine="vllm")),
    ("http://10.0.0.7:30000/;engine=vllm", TeacherEntry("http://10.0.0.7:30000", kind=SERVED, engine="vllm")),
    ("https://teacher.example:8443/v1base;engine=vllm;tokenizer=/tok/qwen35",
     TeacherEntry("https://teacher.example:8443/v1base", kind=SERVED, engine="vllm", tokenizer="/tok/qwen35")),
    ("https://teacher.example;engine = vllm ; tokenizer=/t/tokenizer.json;stop_tokens=maps:f",
     TeacherEntry("https://teacher.example", kind=SERVED, engine="vllm", tokenizer="/t/tokenizer.json",
                  stop_tokens="maps:f")),
])
def test_a_url_is_read_before_the_entry_is_split(entry, want):
    got = parse_entry(entry)
    assert got == want and got.kind == SERVED
    assert got.other_tokenizer == (want.tokenizer is not None) and not got.at_layout


def test_urls_mix_with_paths_providers_and_layouts_in_one_setting():
    raw = "/ckpt/a, http://h:8000;engine=vllm ,/ckpt/b@pkg.mod:provider,/ckpt/c;tokenizer=own;tp=2,https://x:1;engine=vllm"
    teachers = parse_entries(raw)
    assert [t.kind for t in teachers] == [CHECKPOINT, SERVED, PROVIDER, CHECKPOINT, SERVED]
    assert [t.path for t in teachers] == ["/ckpt/a", "http://h:8000", "/ckpt/b", "/ckpt/c", "https://x:1"]
    assert teachers[2].provider == "pkg.mod:provider" and teachers[3].own_tokenizer and teachers[3].tp == 2


def test_the_settings_read_the_table_with_one_weight_per_entry():
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings

    settings = opd_settings({TEACHERS: "/ckpt/a,http://h:8000;engine=vllm,/ckpt/b@m:f",
                             "MEGATRON_RL_PATCHES_OPD_WEIGHTS": "0.5,0.3,0.2"})
    assert [t.kind for t in settings.teachers] == [CHECKPOINT, SERVED, PROVIDER] and settings.weights == (0.5, 0.3, 0.2)
    with pytest.raises(ValueError, match="gives 2 weights for 3 teachers"):
        opd_settings({TEACHERS: "/ckpt/a,http://h:8000;engine=vllm,/ckpt/b@m:f",
                      "MEGATRON_RL_PATCHES_OPD_WEIGHTS": "0.5,0.5"})


def test_a_user_or_password_in_the_url_is_refused_and_never_echoed():
    for entry in ("http://alice:s3cret@h:8000;engine=vllm", "https://s3cret@h;engine=vllm"):
        with pytest.raises(ValueError, match="user or password.*MEGATRON_RL_PATCHES_TEACHER_API_KEY") as caught:
            parse_entry(entry)
        assert "s3cret" not in str(caught.value) and "***@h" in str(caught.value)


@pytest.mark.parametrize(("entry", "words"), [
    ("http://h:8000;engine=sglang", "engine='sglang' is not served yet: serve the teacher with vLLM"),
    ("http://h:8000", r"name the engine serving it, e.g. 'http://h:8000;engine=vllm'"),
    ("http://h:8000;engine=trt", "engine must be one of"),
    ("http://h:8000;engine=vllm;tp=2", "a served teacher runs at its server's own layout"),
    ("http://h:8000;engine=vllm;tokenizer=own", "a served teacher names its tokenizer: ';tokenizer=DIR'"),
    ("http://h:8000;engine=vllm;stop_tokens=m:f", "add ';tokenizer=DIR'"),
    ("http://h:8000;engine=vllm;engine=vllm", "option 'engine' given twice"),
    ("http://h:8000;engine=vllm;temperature=1", "unknown option 'temperature=1'.*';engine=NAME'"),
    ("http://h:port;engine=vllm", "bad port"),
    ("http://h:8000/?x=1;engine=vllm", "without '\\?' or '#'"),
    ("ftp://h:21;engine=vllm", "starts with http:// or https://, got ftp://"),
])
def test_a_bad_served_entry_is_refused_naming_it(entry, words):
    with pytest.raises(ValueError, match=f"{TEACHERS} entry .*{words}"):
        parse_entry(entry)


def test_a_rollout_temperature_other_than_one_is_refused_with_a_served_entry():
    teachers = parse_entries("/ckpt/a,http://h:8000;engine=vllm")
    check_entries(teachers, RunFacts(temperature=1.0))
    check_entries(teachers, RunFacts(temperature=None))  # not known (doctor): nothing to refuse
    with pytest.raises(ValueError, match="entry 'http://h:8000' is a served teacher, and the rollout temperature "
                                         "is 0.7: served engines score prompt log-probs at temperature 1"):
        check_entries(teachers, RunFacts(temperature=0.7))
    check_entries(parse_entries("/ckpt/a,/ckpt/b@m:f"), RunFacts(temperature=0.7))  # in-process: any temperature


def test_the_table_names_each_kind_once_with_the_path_kind_last():
    assert [kind.name for kind in KINDS] == list(REGISTRY) and len(REGISTRY) == len(KINDS)
    assert set(REGISTRY) == {CHECKPOINT, PROVIDER, SERVED, STUDENT}
    assert KINDS[-1].name == CHECKPOINT and all(KINDS[-1].recognizes(e) for e in ("/a", "rel/dir", "x@y"))
    assert TeacherEntry("/a").kind == CHECKPOINT and TeacherEntry("/a", "m:f").kind == PROVIDER


def test_the_table_loads_without_torch_or_the_http_client():
    code = ("import sys, json; from megatron_rl_patches.teachers.kinds import parse_entries; "
            "parse_entries('/a,/b@m:f,/c;tokenizer=own;tp=2'); "
            "print(json.dumps(sorted(m for m in ('torch', 'httpx') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
