"""The engines a served teacher can name, in one table, standard library only (the entry grammar
checks an entry's `;engine=` without importing the client): each name with the module that serves
it, or, for an engine users ask for whose module waits for a test against a real server of its
own, why it is not served yet."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl_patches.teachers.redaction import quoted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from megatron_rl_patches.teachers.served.engines.protocol import ServedEngine


@dataclass(frozen=True)
class EngineName:
    """`engine`: 'module:Class' of the engine scoring rows (None: not served yet, for the reason
    `why_not`); `states`: the one answering hidden states (a teacher with a head)."""

    engine: str | None
    why_not: str = ""
    states: str | None = None


ENGINES = {
    "vllm": EngineName("megatron_rl_patches.teachers.served.engines.vllm:VllmEngine",
                       states="megatron_rl_patches.teachers.served.engines.vllm_pooling:VllmPoolingEngine"),
    "sglang": EngineName(None, "its server needs CUDA packages, so no test here runs one"),
}
SERVED_ENGINES = tuple(name for name, row in ENGINES.items() if row.engine is not None)


def check_engine(engine: object) -> str:
    """`engine` as a served engine's name; TypeError (not a str) or ValueError naming it otherwise."""
    if not isinstance(engine, str):
        raise TypeError(f"engine must be a str naming the served engine, e.g. engine='vllm' (one of "
                        f"{sorted(SERVED_ENGINES)}), got {engine!r}, a {type(engine).__name__}")
    row = ENGINES.get(engine)
    if row is not None and row.engine is None:
        raise ValueError(f"engine={engine!r} is not served yet: serve the teacher with vLLM (engine='vllm'); "
                         f"{row.why_not}")
    if row is None:
        raise ValueError(f"engine must be one of {sorted(SERVED_ENGINES)}, got {quoted(engine)}")
    return str(engine)


def engine_class(engine: str, states: bool = False) -> Callable[..., ServedEngine]:
    """The class of the served engine `engine` (checked by `check_engine`) scoring rows, or with
    `states` answering hidden states, imported now."""
    row = ENGINES[check_engine(engine)]
    where = row.states if states else row.engine
    assert where is not None  # check_engine refuses the engines not served yet; hidden_head those without states
    module, _, name = where.partition(":")
    cls: Callable[..., ServedEngine] = getattr(importlib.import_module(module), name)
    return cls

# the fix a pooling server's refusal of prompt log-probs names (`ServedTeacher`'s words); where the
# teacher comes from an entry of the teacher grammar, the entry's own option is named instead
HEAD_FIX = "give ServedTeacher(head=...) the teacher's checkpoint"
ENTRY_HEAD_FIX = "add ';head=DIR' (the teacher's Hugging Face directory) to the entry"


def in_entry_words(message: str) -> str:
    """A served teacher's refusal as an entry's check says it: the entry's option for the fix."""
    return message.replace(HEAD_FIX, ENTRY_HEAD_FIX)
