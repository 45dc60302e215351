"""Teachers (slime_opd's, and `inference_roles`' frozen roles) from Hugging Face directories of
another architecture than the actor's: the routing decision (a `PATH` whose config.json shapes
the same model as the actor goes slime's way, into the actor's buffers; one that differs is
built by `build_inference_model_from_hf` as a separate inference-only model on the actor's
tensor / pipeline / expert split), the vocabulary check against the student before anything is
built, and the build.

Every rank reads the files; they agree on each decision by a collective before acting on it, so a
rank that sees another file system fails with the others instead of leaving them waiting."""
# lazy imports: import cost: torch loads where a teacher is built or the ranks agree; the loading decision loads none
from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer
from megatron_rl_patches.inference.loading.hf.checkpoint_config import CONFIG, hub_cache_problem, read_checkpoint_config
from megatron_rl_patches.inference.loading.hf.families import architecture
from megatron_rl_patches.inference.loading.hf.vocab import check_teacher_vocab
from megatron_rl_patches.integrations.megatron.opd.actor_spec import actor_layer_spec, spec_core_attention
from megatron_rl_patches.integrations.megatron.opd.opd_settings import OWN_TOKENIZER, TEACHERS
from megatron_rl_patches.integrations.megatron.opd.teacher_shape import shape_differences
from megatron_rl_patches.model.chunks import unwrap

SNAPSHOT, HF = "snapshot", "hf"
_LOADINGS = (SNAPSHOT, HF)


def local_loading(path: str, args: Any, what: str) -> tuple[str, list[str]]:
    """(loading, differences) of a `PATH` teacher as this rank sees the file: a Hugging Face
    directory whose config.json differs from the actor -> HF; anything else -> slime's snapshot
    loading (slime's load_checkpoint: Megatron checkpoints, Hugging Face directories of the
    actor's architecture). A Hugging Face file (config.json, *.safetensors) instead of its
    directory, a hub cache folder (models--ORG--NAME), or a directory of safetensors without
    config.json, is refused (`what` names the setting, e.g. "MEGATRON_RL_PATCHES_OPD_TEACHERS:
    teacher '/ckpt/t'")."""
    root = Path(path).expanduser()
    if root.is_file() and (root.name == CONFIG or root.suffix == ".safetensors"):
        raise ValueError(f"{what} is a file of a Hugging Face checkpoint; name the directory that holds "
                         f"{CONFIG} and the *.safetensors files")
    cache = hub_cache_problem(root) if root.is_dir() else None
    if cache is not None:
        raise ValueError(f"{what} {cache}")
    if not root.is_dir() or not (root / CONFIG).is_file():
        if root.is_dir() and any(root.glob("*.safetensors")):
            raise ValueError(f"{what} holds *.safetensors but no {CONFIG}; a Hugging Face "
                             f"teacher needs its {CONFIG} (copy it from the model's repository)")
        return SNAPSHOT, []
    config = read_checkpoint_config(root).fields
    differences = shape_differences(config, args)
    if not differences:
        return SNAPSHOT, []
    architecture(config, source=path)  # an unserved family or feature: UnsupportedCheckpointError naming it
    return HF, differences


def _agreed(code: int) -> tuple[int, int]:
    """(min, max) of `code` over every rank (itself without a process group)."""
    # lazy: import cost: torch (the settings checks import this module without it)
    from megatron_rl_patches.ops import agreement

    return agreement.agreed_range(agreement.world(), code)


def teacher_loading(path: str, args: Any, what: str) -> tuple[str, list[str]]:
    """`local_loading`, agreed by every rank first: a rank whose check failed raises its own error,
    the others name the disagreement, and ranks that decided differently all raise."""
    error: Exception | None = None
    try:
        loading, differences = local_loading(path, args, what)
        code = _LOADINGS.index(loading)
    except (ValueError, OSError) as exc:
        error, loading, differences, code = exc, SNAPSHOT, [], len(_LOADINGS)
    low, high = _agreed(code)
    if error is not None:
        raise error
    if high == len(_LOADINGS):
        raise ValueError(f"{what}: another rank refused it (its error is in that rank's log)")
    if low != high:
        raise ValueError(f"{what}: the ranks see it differently (a Hugging Face directory of another "
                         "architecture on some, not on others): every node needs the same files")
    return loading, differences


def check_allgather_cp(args: Any, what: str) -> None:
    """ValueError naming slime's --allgather-cp (with context parallelism) for a Hugging Face
    teacher built on the actor's split: its layers run megatron-core's rotary embedding, whose
    packed (thd) path cuts each sequence in zigzag, while --allgather-cp hands each rank a
    contiguous slice of the packed stream (wrong positions; a shape error where the cuts differ)."""
    if getattr(args, "allgather_cp", False) and (getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ValueError(f"{what} is a Hugging Face directory of another architecture than the actor's, built "
                         "on the actor's split, which is not served with --allgather-cp: megatron-core's rotary "
                         "embedding cuts packed sequences in zigzag, --allgather-cp gives each rank a contiguous "
                         "slice; run it without --allgather-cp, or give the teacher the actor's architecture "
                         "(slime's snapshot route)")


def student_vocab(args: Any, padded: int) -> int | str:
    """What the teacher's vocabulary is checked against: the actor's Hugging Face directory
    (slime's --hf-checkpoint: its vocab_size and tokenizer ids), else its real vocab size."""
    hf = getattr(args, "hf_checkpoint", None)
    if isinstance(hf, str) and (Path(hf).expanduser() / CONFIG).is_file():
        return hf
    return int(getattr(args, "vocab_size", None) or padded)


def packed_core_attention(args: Any) -> type | None:
    """The attention core for slime's packed `thd` batches, the actor's own: Transformer Engine's
    where slime runs with it; the core attention of the actor's `--spec MODULE NAME` where it runs a
    custom local spec; else megatron-core's local one (None), which refuses packed batches."""
    if getattr(args, "transformer_impl", "transformer_engine") != "transformer_engine":
        spec = actor_layer_spec(args)
        return None if spec is None else spec_core_attention(spec, f"the actor's --spec {' '.join(args.spec)}")
    try:
        # lazy: optional dependency megatron-core (and Transformer Engine: None without it)
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError:
        return None
    return TEDotProductAttention


def check_vocab(path: str, student: int | str, what: str) -> int:
    """The teacher's vocabulary against the student's (`check_teacher_vocab`), naming the setting
    (an OPD teacher's error: how its entry asks for a teacher with another tokenizer); the shared
    real vocab size."""
    try:
        return check_teacher_vocab(path, student)
    except ValueError as exc:
        entry = f", or in {TEACHERS} ask for it with the entry '{path};{OWN_TOKENIZER}'" \
            if what.startswith(TEACHERS) else ""
        raise ValueError(f"{what.partition(': ')[0]}: {exc}{entry}") from None  # the error names the path itself


# The actor's schedule settings the teacher's config must share: slime's forward_only reads the
# p2p shapes and batching from the model it runs (packed batches have variable lengths).
SCHEDULE_FIELDS = ("variable_seq_lengths", "batch_p2p_comm", "batch_p2p_sync", "microbatch_group_size_per_vp_stage")


def build_hf_teacher(args: Any, path: str, residency: str | None, student: int | str, actor_config: Any,
                     what: str, own_tokenizer: bool = False, layout: Any = None) -> list[Any]:
    """The teacher at `path` as inference-only chunks on the actor's split (vocabulary checked
    first, padded as the actor's `make_vocab_size_divisible_by`, in the actor's dtype);
    `own_tokenizer`: its vocabulary is its own tokenizer's (no mass beyond its ids); `layout`: a
    TeacherLayout, the teacher built at its own sizes on its own groups (at `residency` too;
    megatron-core's local attention core: it is scored on padded batches with a causal mask, not
    slime's packed ones)."""
    import torch

    from megatron_rl_patches.inference.build_hf import build_inference_model_from_hf

    if own_tokenizer:
        shared = int(load_tokenizer(path, what).get_vocab_size(with_added_tokens=True))
    else:
        shared = check_vocab(path, student, what)
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
        else getattr(args, "params_dtype", None)
    chunks = build_inference_model_from_hf(
        path, residency=residency or "resident", dtype=dtype if isinstance(dtype, torch.dtype) else None,
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", None) or 128,
        core_attention=None if layout is not None else packed_core_attention(args), layout=layout)
    for chunk in chunks:
        # one tokenizer padded to another vocab_size than the student's: no mass beyond the shared ids
        setattr(chunk, "hf_vocab_size", min(shared, int(getattr(chunk, "hf_vocab_size"))))  # noqa: B009, B010
        inner = unwrap(chunk)
        for name in SCHEDULE_FIELDS:
            if hasattr(actor_config, name):
                setattr(inner.config, name, getattr(actor_config, name))
    return chunks
