"""The served kind: `http://host:port;engine=vllm` (or `https://`) — a teacher served by an
inference engine, asked over HTTP (`teachers.ServedTeacher`); its replicas' URLs joined by '|'
before the options (`http://a:8000|http://b:8000;engine=vllm`). The URL is read before the entry
is split further (its ':' and '/' are no path, its '@' no provider); a user or password in it was
refused where the entry came in, on the raw text, before anything split it (`teachers.kinds`; the
API key comes from MEGATRON_RL_PATCHES_TEACHER_API_KEY). Options: `;engine=vllm`
(required: the engines answer on different routes), `;tokenizer=DIR` (another tokenizer than the
student's: a directory or tokenizer.json, `;stop_tokens=module:function` with it), `;same_tokenizer`
with `;vocab=N` or `;config=PATH` (a server without a tokenizer to probe, `--skip-tokenizer-init`:
the user's word that it is the student's, its vocabulary size named), `;head=DIR` (the teacher's
Hugging Face directory: the server sends final hidden states, vLLM's pooling runner, and the
trainer projects them through the directory's output layer; with `;tokenizer=DIR` the
chunk-start buckets of another tokenizer scored exactly through it). Engines score at temperature 1 only:
without a head another rollout temperature is refused. `doctor` asks the server."""
from __future__ import annotations

import dataclasses
import re
import urllib.parse
from pathlib import Path
from typing import Any

from megatron_rl_patches.ops.scoring_plan import ScoringPlan
from megatron_rl_patches.settings import OPD_TEACHERS as TEACHERS
from megatron_rl_patches.settings import ascii_int
from megatron_rl_patches.teachers.entry import SERVED, RunFacts, TeacherEntry
from megatron_rl_patches.teachers.kinds.kind import TeacherKind
from megatron_rl_patches.teachers.kinds.options import (
    OWN_TOKENIZER,
    STOP_TOKENS,
    context_option,
    is_provider,
    split_entry,
)
from megatron_rl_patches.teachers.redaction import quoted, redacted
from megatron_rl_patches.teachers.served.engines.names import SERVED_ENGINES, check_engine, in_entry_words
from megatron_rl_patches.teachers.served.tokenizer_probe import SAME_TOKENIZER, probe_tokenizer

FORM = ("http(s)://host:port;engine=vllm (a teacher served by vLLM; its replicas' URLs joined by '|'; "
        ";tokenizer=DIR for another tokenizer; "
        ";same_tokenizer;vocab=N for a server without a tokenizer; ;head=DIR for its hidden states through the "
        "head of its Hugging Face directory)")
ENGINE, TOKENIZER, HEAD = "engine=", "tokenizer=", "head="
VOCAB, CONFIG = "vocab=", "config="
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# doctor's bounds: a server that does not answer is a problem in seconds, not a hang
DOCTOR_CONNECT_S, DOCTOR_DEADLINE_S = 5.0, 15.0


def recognizes(entry: str) -> bool:
    """Whether the entry starts with a URL (`scheme://`): read as one before anything splits it."""
    return SCHEME.match(entry) is not None


def check_url_head(said: str, head: str) -> str:
    """The URL(s) of an entry named as `said` (its user or password refused where it came in):
    each replica's http or https, no query, its trailing '/' dropped; joined by '|' again."""
    from megatron_rl_patches.teachers.replica_urls import SEPARATOR, replica_pieces  # lazy: import cost

    try:
        urls = replica_pieces(head)
    except ValueError as exc:
        raise ValueError(f"{said}: {exc}") from None
    return SEPARATOR.join(check_one_url(said, url) for url in urls)


def check_one_url(said: str, url: str) -> str:
    """One URL of an entry: http or https, no query; its trailing '/' dropped."""
    from megatron_rl_patches.teachers.served.http import url_form  # lazy: import cost (ssl, json)

    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{said}: a served teacher's URL starts with http:// or https://, got {parts.scheme}://")
    try:
        return url_form(url)
    except ValueError as exc:
        raise ValueError(f"{said}: {exc}") from None


# what an option's value names, where it is left empty
VALUES = {"tokenizer": "the served teacher's tokenizer (a directory holding tokenizer.json, or the file)",
          "head": "the teacher's Hugging Face directory (its output layer turns the served hidden states into its "
                  "distribution)",
          "config": "the served model's config.json (or the directory holding it)"}


def parse(entry: str, said: str) -> TeacherEntry:
    head, options = split_entry(entry, said)
    url = check_url_head(said, head.strip())
    context, options = context_option(said, options)
    engine = tokenizer = stop = config = head_dir = None
    vocab: int | None = None
    same = False
    for option in options:
        name, _, value = (part.strip() for part in option.partition("="))
        if name == "engine":
            try:
                engine = check_engine(value)
            except ValueError as exc:
                raise ValueError(f"{said}: {exc}") from None
        elif name == "tokenizer" and value == "own":
            raise ValueError(f"{said}: ';{OWN_TOKENIZER}' reads a checkpoint directory's "
                             "tokenizer.json; a served teacher names its tokenizer: ';tokenizer=DIR' (a directory "
                             "holding tokenizer.json, or the file)")
        elif name in VALUES and "=" in option and not value:
            raise ValueError(f"{said}: option {quoted(option)} is empty: {name}= names {VALUES[name]}; give it, "
                             "or drop the option")
        elif name == "tokenizer" and value:
            tokenizer = value
        elif name == "head" and value:
            head_dir = value
        elif name == "stop_tokens" and is_provider(value):
            stop = value
        elif option == SAME_TOKENIZER:
            same = True
        elif name == "vocab":
            vocab = ascii_int(value)  # digit-bounded: int() of 4,300 digits or more raises a message naming nothing
            if not vocab:
                raise ValueError(f"{said}: option {quoted(option)} must be ';{VOCAB}N', the served model's "
                                 "vocabulary size: a positive int in ASCII digits (its config.json's vocab_size)")
        elif name == "config" and value:
            config = value
        elif name in ("tp", "pp", "ep"):
            raise ValueError(f"{said}: option {quoted(option)}: a served teacher runs at its server's "
                             "own layout (set it where the engine starts); drop it")
        else:
            raise ValueError(f"{said}: unknown option {quoted(option)}; a served teacher's options "
                             f"are ';{ENGINE}NAME' (one of {list(SERVED_ENGINES)}), ';{TOKENIZER}DIR' (another "
                             f"tokenizer than the student's: a directory or tokenizer.json), "
                             f"';{STOP_TOKENS}module:function' (with it), ';{SAME_TOKENIZER}' with "
                             f"';{VOCAB}N' or ';{CONFIG}PATH' (a server without a tokenizer) and ';{HEAD}DIR' (the "
                             "teacher's Hugging Face directory: its hidden states served, projected through its head "
                             "here)")
    if engine is None:
        raise ValueError(f"{said}: name the engine serving it, e.g. '{url};engine=vllm' "
                         f"(served: {list(SERVED_ENGINES)})")
    if stop is not None and tokenizer is None:
        raise ValueError(f"{said}: ';{STOP_TOKENS}' maps tokens between two tokenizers; add "
                         f"';{TOKENIZER}DIR' or drop it")
    check_same_tokenizer_options(said, same, tokenizer, vocab, config)
    return TeacherEntry(url, stop_tokens=stop, kind=SERVED, engine=engine, tokenizer=tokenizer, same_tokenizer=same,
                        vocab=vocab, config=config, head=head_dir, context=context)


def check_same_tokenizer_options(said: str, same: bool, tokenizer: str | None, vocab: int | None,
                                 config: str | None) -> None:
    """`;same_tokenizer` with exactly one of `;vocab=N` / `;config=PATH`, without `;tokenizer=DIR`;
    those two only with it (refusals naming the entry as `said`)."""
    if not same and (vocab is not None or config is not None):
        raise ValueError(f"{said}: ';{VOCAB}' / ';{CONFIG}' name the vocabulary of a served model "
                         f"whose tokenizer cannot be probed; add ';{SAME_TOKENIZER}' (your word that it is the "
                         "student's) or drop them")
    if same and tokenizer is not None:
        raise ValueError(f"{said}: ';{SAME_TOKENIZER}' and ';{TOKENIZER}' contradict each other: "
                         "keep one")
    if same and (vocab is None) == (config is None):
        raise ValueError(f"{said}: ';{SAME_TOKENIZER}' takes the served model's vocabulary size "
                         f"from exactly one of ';{VOCAB}N' or ';{CONFIG}PATH' (its config.json, or the directory "
                         "holding it), checked against the student's tokenizer; name one")


def check(entry: TeacherEntry, facts: RunFacts) -> None:
    """Engines score prompt log-probs at temperature 1 whatever is asked, while the teachers score
    at the run's temperature (slime: its rollout temperature): another one is refused, except with
    a head (`;head=DIR`: the trainer forms the distribution at any temperature)."""
    if entry.head is None and facts.temperature is not None and float(facts.temperature) != 1.0:
        raise ValueError(f"{TEACHERS} entry '{entry.path}' is a served teacher, and {facts.temperature_from} is "
                         f"{facts.temperature:g}: served engines score prompt log-probs at temperature 1 whatever is "
                         f"asked (so would not score at the student's temperature); set {facts.temperature_from} to "
                         "1, or use an in-process teacher")


def problems(entry: TeacherEntry, facts: RunFacts) -> list[str]:
    """What `report` finds wrong."""
    return report(entry, facts)[0]


def report(entry: TeacherEntry, facts: RunFacts) -> tuple[list[str], list[str]]:
    """The server asked now, without loading anything (`ServedTeacher.check`: it answers, the
    model it serves, its max model length, k within its --max-logprobs), in bounded time; the
    tokenizer of `;tokenizer=DIR` present and the served model's (its `/tokenize` of a probe). With
    `;head=DIR`: its config.json and head tensor found (no weight read), the server's pooling task
    answering with states of the head's hidden size, and DIR's tokenizer.json the served model's.
    Replicas (URLs joined by '|'): each checked so, then all of them as one teacher (the same
    model, tokenizer and width on each). (problems, and when none: one line per check saying what
    was checked: the URL, engine, route, model.)"""
    found: list[str] = []
    k = "K=vocab" if facts.full_vocab else f"k={facts.k}"
    named: Path | None = None
    named_size = None
    if entry.same_tokenizer:
        from megatron_rl_patches.teachers.named_vocab import named_vocab_size  # lazy: import cost

        try:
            named_size = named_vocab_size(entry, f"{TEACHERS}: teacher '{entry.path}'")
        except ValueError as exc:
            found.append(str(exc))
    if entry.tokenizer is not None:
        tokenizer = Path(entry.tokenizer).expanduser()
        if tokenizer.is_file() or (tokenizer / "tokenizer.json").is_file():
            named = tokenizer
        else:
            found.append(f"{TEACHERS}: teacher '{entry.path}' names ';{TOKENIZER}{entry.tokenizer}', which is neither "
                         "a tokenizer.json nor a directory holding one on this machine")
    urls = entry.path.split("|")
    checked: list[str] = []
    said = f"served teacher '{redacted(entry.path)}'"
    for url in urls:  # each replica on its own, then (several, all answering) the replicas as one teacher
        which = "" if len(urls) == 1 else f" replica '{redacted(url)}'"
        line = served_problem(found, entry, url, facts, named, named_size, f"{said}{which} ({entry.engine}, {k})")
        checked += [] if line is None else [line]
    if len(urls) > 1 and len(checked) == len(urls):
        line = served_problem(found, entry, entry.path, facts, named, named_size,
                              f"{said} (its {len(urls)} replicas as one teacher) ({entry.engine}, {k})")
        checked += [] if line is None else [line]
    return found, [] if found else checked


def served_problem(found: list[str], entry: TeacherEntry, url: str, facts: RunFacts, named: Path | None,
                   named_size: int | None, said: str) -> str | None:
    """The server(s) at `url` asked as `report` says, within doctor's bounds: what was checked, or
    None with a problem (starting with `said`) appended to `found`."""
    try:
        # lazy: optional dependency httpx (the served client, imported by served teachers only)
        from megatron_rl_patches.teachers.served.build import served_teacher_of  # lazy: optional dependency httpx
        from megatron_rl_patches.teachers.served.http import Deadline  # lazy: optional dependency httpx
        from megatron_rl_patches.teachers.served.settings import ClientSettings  # lazy: import cost (the client wing)

        settings = ClientSettings(connect_timeout_s=DOCTOR_CONNECT_S, timeout_s=DOCTOR_DEADLINE_S,
                                  deadline_s=DOCTOR_DEADLINE_S, retries=0)
        deadline = Deadline.after(DOCTOR_DEADLINE_S)  # the check and the probe within one bound
        head = None if entry.head is None else planned_head(entry.head)
        if head is not None and named_size is not None:
            from megatron_rl_patches.teachers.named_vocab import check_head_vocab  # lazy: import cost

            check_head_vocab(named_size, head.vocab_size, entry.head, "the entry")
        if head is not None and named is None and not entry.same_tokenizer and \
                (Path(head.source) / "tokenizer.json").is_file():
            named = Path(head.source)  # the head's vocabulary: its directory's tokenizer, probed below
        asked = dataclasses.replace(entry, path=url, context=None)  # this replica (or all), nothing to score
        with served_teacher_of(asked, ScoringPlan(facts.k), client=settings, head=head) as teacher:
            model = teacher.served_model(deadline)  # with a head: the pooling task answers, at the head's width
            checked = (f"{said}: answers, serves {model.name!r} (max model length {model.max_model_len}); route: "
                       + ("prompt log-probs, k within its --max-logprobs" if head is None else
                          f"hidden states through the head of {entry.head} ({head.vocab_size} x {head.hidden_size}, "
                          f"{str(head.dtype).removeprefix('torch.')}), the pooling task at width {head.hidden_size}"))
            if named is not None:  # the served model's tokenizer is the one the entry names
                # lazy: optional dependency tokenizers (a served teacher of another tokenizer only)
                from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer

                whose = f"';{TOKENIZER}{entry.tokenizer}'" if entry.tokenizer is not None else f"';{HEAD}{entry.head}'"
                probe_tokenizer(teacher, load_tokenizer(str(named), whose), "its tokenizer",
                                f"the tokenizer {whose} names", deadline)
                checked += f"; its tokenizer the one {whose} names"
    except (ValueError, TypeError, RuntimeError, ImportError, OSError) as exc:  # ServedTeacherError: a RuntimeError
        found.append(f"{TEACHERS}: {said} fails its check: {in_entry_words(str(exc))}")
        return None
    return checked


def planned_head(directory: str) -> Any:
    """A `TeacherHead` of `;head=DIR` without its weights (on the meta device): config.json's
    vocabulary and hidden size, the head tensor found in the checkpoint's index (its dtype: the one
    the states travel in), for the server's checks."""
    import torch  # lazy: import cost (doctor's other checks need no torch)

    from megatron_rl_patches.teachers.head.teacher_head import HeadPlan, TeacherHead  # lazy: import cost (torch)

    plan = HeadPlan.of(directory, None, None, 1, 0, fingerprinted=False)
    weight = torch.empty(plan.vocab_size, plan.hidden_size, dtype=plan.dtype, device="meta")
    return TeacherHead(weight, plan.vocab_size, plan.vocab_size, 0, None, str(plan.root), plan.own_dtype)


def build(entry: TeacherEntry, host: Any, options: Any) -> Any:
    """The entry's connected `ServedTeacher` (`teachers.served.build`)."""
    from megatron_rl_patches.teachers.served.build import build_served  # lazy: import cost: httpx, torch

    return build_served(entry, host, options)


KIND = TeacherKind(SERVED, FORM, recognizes=recognizes, parse=parse, check=check, problems=problems, report=report,
                   build=build)
