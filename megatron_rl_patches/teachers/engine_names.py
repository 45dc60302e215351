"""The engines a served teacher can name, standard library only (the entry grammar checks an
entry's `;engine=` without importing the client): those served, and those named by users whose
module waits for a test against a real server of theirs."""
from __future__ import annotations

SERVED_ENGINES = ("vllm",)
NOT_SERVED_YET = {"sglang": "its server needs CUDA packages, so no test here runs one"}


def check_engine(engine: object) -> str:
    """`engine` as a served engine's name; ValueError naming it otherwise."""
    if engine in NOT_SERVED_YET:
        raise ValueError(f"engine={engine!r} is not served yet: serve the teacher with vLLM (engine='vllm'); "
                         f"{NOT_SERVED_YET[str(engine)]}")
    if engine not in SERVED_ENGINES:
        raise ValueError(f"engine must be one of {sorted(SERVED_ENGINES)}, got {engine!r}")
    return str(engine)
