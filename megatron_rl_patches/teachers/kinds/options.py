"""The pieces an entry is written in: `HEAD;option;option` (options `name=value` or a bare word),
each option given once; `module:function` names; how every message names an entry (`entry_named`:
the setting the user set, passed in by whoever reads it). Standard library only."""
from __future__ import annotations

from megatron_rl_patches.settings import OPD_TEACHERS as TEACHERS
from megatron_rl_patches.teachers.redaction import quoted

# An entry's options after its head: `PATH;tokenizer=own` (a Hugging Face teacher with another
# tokenizer than the student's), `;stop_tokens=module:function` (with it: student special id ->
# the teacher's id or None), `URL;engine=vllm`, `URL;tokenizer=DIR`; any kind's `;context=KEY` (a
# privileged context per sample under KEY).
OWN_TOKENIZER = "tokenizer=own"
STOP_TOKENS = "stop_tokens="
CONTEXT = "context="


def entry_named(entry: str, setting: str = TEACHERS) -> str:
    """How every message names `entry`, one of the comma-separated entries of `setting` (the
    variable or argument it came in; its user or password refused there already), a long one cut."""
    return f"{setting} entry {quoted(entry)}"


def variable_named(raw: str, variable: str) -> str:
    """How every message names the one entry a variable holds (verl's): as the user set it, a long
    one cut."""
    return f"{variable}={quoted(raw.strip())}"


def is_provider(spec: str) -> bool:
    """`module:function`: a dotted module name and a function name, both non-empty identifiers."""
    module, colon, function = spec.partition(":")
    return bool(colon) and all(part.isidentifier() for part in module.split(".")) and function.isidentifier()


def split_entry(entry: str, said: str) -> tuple[str, list[str]]:
    """(head, its options stripped) of an entry; an option named twice refused naming the entry
    as `said`."""
    head, *written = entry.split(";")
    options = [option.strip() for option in written]
    seen: set[str] = set()
    for option in options:
        name = option.partition("=")[0].strip()
        if name and name in seen:
            raise ValueError(f"{said}: option {name!r} given twice; give each option "
                             "once (no later value overrides an earlier one)")
        seen.add(name)
    return head, options


def stop_tokens(option: str) -> str | None:
    """The `module:function` of a well-written `stop_tokens=module:function` option, else None."""
    if option.startswith(STOP_TOKENS) and is_provider(option[len(STOP_TOKENS):].strip()):
        return option[len(STOP_TOKENS):].strip()
    return None


def context_option(said: str, options: list[str]) -> tuple[str | None, list[str]]:
    """(the KEY of a `;context=KEY` option or None, the other options) of an entry's options; an
    empty KEY refused naming the entry as `said`."""
    key, others = None, []
    for option in options:
        name, _, value = (part.strip() for part in option.partition("="))
        if name != CONTEXT[:-1]:
            others.append(option)
        elif not value:
            raise ValueError(f"{said}: ';{CONTEXT}' names no key: write ';{CONTEXT}KEY' "
                             "(the key of each sample's privileged context in the loop's per-sample data)")
        else:
            key = value
    return key, others
