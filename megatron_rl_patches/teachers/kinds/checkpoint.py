"""The checkpoint kind: `PATH` — a checkpoint of the actor's architecture (slime loads it into the
actor's buffers) or a Hugging Face directory of another architecture (built from its config.json;
which one is decided from the files when the teachers load). Options: `;tokenizer=own` (another
tokenizer than the student's, `;stop_tokens=module:function` with it) and `;tp=N` / `;pp=N` (a
Hugging Face directory at its own layout). `doctor` checks the path and a Hugging Face
directory's files without building anything."""
from __future__ import annotations

from pathlib import Path

from megatron_rl_patches.settings import OPD_TEACHERS as TEACHERS
from megatron_rl_patches.settings import is_layout_option, layout_size
from megatron_rl_patches.teachers.entry import CHECKPOINT, RunFacts, TeacherEntry
from megatron_rl_patches.teachers.kinds.kind import TeacherKind
from megatron_rl_patches.teachers.kinds.options import (
    OWN_TOKENIZER,
    STOP_TOKENS,
    context_option,
    split_entry,
    stop_tokens,
)
from megatron_rl_patches.teachers.redaction import quoted

FORM = "PATH (same architecture as the actor, or a Hugging Face directory of another architecture)"


def path_options(said: str, options: list[str]) -> tuple[bool, str | None, dict[str, int]]:
    """(own tokenizer asked, the stop-token map's module:function, the teacher's own sizes: "tp" /
    "pp" -> size where written) from a path entry's options (refusals naming it as `said`)."""
    own, stop = False, None
    sizes: dict[str, int] = {}
    for option in options:
        if option.replace(" ", "") == OWN_TOKENIZER:
            own = True
        elif stop_tokens(option) is not None:
            stop = stop_tokens(option)
        elif is_layout_option(option):
            size, value = layout_size(option, said)
            if size != "ep":  # ep=1: the only expert size served, nothing to record
                sizes[size] = value
        else:
            raise ValueError(f"{said}: unknown option {quoted(option)}; the options are "
                             f"';{OWN_TOKENIZER}' (a Hugging Face teacher with another tokenizer, e.g. "
                             f"/ckpt/qwen35;{OWN_TOKENIZER}), ';{STOP_TOKENS}module:function' (with it: "
                             "student special id -> teacher id or None) and ';tp=N' / ';pp=N' (the teacher at its "
                             "own tensor / pipeline-parallel sizes)")
    if stop is not None and not own:
        raise ValueError(f"{said}: ';{STOP_TOKENS}' maps tokens between two tokenizers; add "
                         f"';{OWN_TOKENIZER}' or drop it")
    return own, stop, sizes


def expected_forms(said: str) -> ValueError:
    """The error of an entry no kind reads (named as `said`): what an entry can be."""
    return ValueError(f"{said}: expected PATH (same architecture as the actor), "
                      "PATH@module:function (a provider for another architecture, e.g. "
                      f"/ckpt/teacher@my_models:teacher_provider), PATH;{OWN_TOKENIZER} (a Hugging Face "
                      "directory with another tokenizer) or http(s)://host:port;engine=vllm (a teacher served by "
                      "vLLM)")


def parse(entry: str, said: str) -> TeacherEntry:
    head, options = split_entry(entry, said)
    if not head.strip():
        raise expected_forms(said)
    context, options = context_option(said, options)
    own, stop, sizes = path_options(said, options)
    return TeacherEntry(head.strip(), None, own, stop, sizes.get("tp"), sizes.get("pp"), kind=CHECKPOINT,
                        context=context)


def path_problems(entry: TeacherEntry, facts: RunFacts) -> list[str]:
    """What loading the teacher at `entry.path` would fail on, found now: a path that does not
    exist, a hub cache folder instead of its snapshot or a checkpoint's file instead of its
    directory, a Hugging Face directory build_inference_model_from_hf or the vocabulary check
    refuses (its config.json, read as every entry point reads it, or its weight files; nothing
    built), a `;tokenizer=own` teacher without its tokenizer.json."""
    # lazy: import cost: the converter's readers (torch) serve `doctor` only; the settings import none
    from megatron_rl_patches.inference.loading.hf.checkpoint_config import (
        CONFIG,
        TOKENIZER,
        hub_cache_problem,
        read_checkpoint_config,
    )
    from megatron_rl_patches.inference.loading.hf.families import read_architecture  # lazy: import cost: as above
    from megatron_rl_patches.inference.loading.hf.files import tensor_index  # lazy: import cost: as above

    root = Path(entry.path).expanduser()
    what = f"{TEACHERS}: teacher {entry.path!r}"
    try:
        root.stat()
    except FileNotFoundError:
        return [f"{what} does not exist on this machine; fix the path (the training actors read it)"]
    except OSError as exc:  # a name too long, a component that is no folder: no checkpoint can be there
        return [f"{what} cannot be looked at on this machine ({exc.strerror}); fix the path"]
    cache = hub_cache_problem(root) if root.is_dir() else None
    if cache is not None:
        return [f"{what} {cache}"]
    if root.is_file() and root.suffix in (".json", ".safetensors"):  # hf_teachers refuses it at load time
        return [f"{what} is a file of a Hugging Face checkpoint; name its directory {str(root.parent)!r}"]
    problems = []
    if root.is_dir() and (root / CONFIG).is_file():
        try:
            read_checkpoint_config(root, TEACHERS).vocab_size  # noqa: B018 - check_teacher_vocab's reading
            read_architecture(root, TEACHERS)
            tensor_index(root)
        except (ValueError, OSError, ImportError) as exc:  # ImportError: no safetensors library (the hf extra)
            problems.append(f"{what}: a Hugging Face directory build_inference_model_from_hf refuses ({exc}); "
                            "it loads only through slime's own loader, with the actor's architecture")
    if entry.own_tokenizer and not (root / TOKENIZER).is_file():
        problems.append(f"{what} asks ';{OWN_TOKENIZER}' but {str(root / TOKENIZER)!r} does not exist: the "
                        f"teacher's own tokenizer is read from it; put the model's {TOKENIZER} there (e.g. "
                        f"`hf download ORG/NAME {TOKENIZER} --local-dir {entry.path}`)")
    return problems


KIND = TeacherKind(CHECKPOINT, FORM, recognizes=lambda entry: True, parse=parse, problems=path_problems)
