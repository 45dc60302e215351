"""The provider kind: `PATH@module:function` — a Megatron checkpoint of another architecture,
built inference-only from the model provider the function returns (called with the framework's
arguments). It takes no option: another tokenizer and a layout of its own serve Hugging Face
directories only."""
from __future__ import annotations

from megatron_rl_patches.settings import written_sizes
from megatron_rl_patches.teachers.entry import PROVIDER, TeacherEntry
from megatron_rl_patches.teachers.kinds.checkpoint import expected_forms, path_options, path_problems
from megatron_rl_patches.teachers.kinds.kind import TeacherKind
from megatron_rl_patches.teachers.kinds.options import OWN_TOKENIZER, context_option, is_provider, split_entry

FORM = "PATH@module:function (a provider for another architecture, e.g. /ckpt/teacher@my_models:teacher_provider)"


def recognizes(entry: str) -> bool:
    return "@" in entry.partition(";")[0]


def parse(entry: str, said: str) -> TeacherEntry:
    head, options = split_entry(entry, said)
    path, _, provider = head.partition("@")
    if not path.strip() or not is_provider(provider.strip()):
        raise expected_forms(said)
    context, options = context_option(said, options)
    own, _, sizes = path_options(said, options)
    if own:
        raise ValueError(f"{said}: ';{OWN_TOKENIZER}' serves Hugging Face directories (their "
                         "tokenizer.json is read); drop '@module:function' or the option")
    if sizes:
        raise ValueError(f"{said}: ';{written_sizes(sizes.get('tp'), sizes.get('pp'))}' serves "
                         "Hugging Face directories of another architecture (built from their config.json); a "
                         "provider's model '@module:function' is not served at its own layout yet: drop ';tp=' / "
                         "';pp=' or the provider")
    return TeacherEntry(path.strip(), provider.strip(), kind=PROVIDER, context=context)


KIND = TeacherKind(PROVIDER, FORM, recognizes=recognizes, parse=parse, problems=path_problems)
