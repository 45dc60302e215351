"""A teacher's own parallel layout as a setting writes it: the `;tp=N` option of a
MEGATRON_RL_PATCHES_OPD_TEACHERS entry or a MEGATRON_RL_PATCHES_INFERENCE_ROLES role (also
`;pp=N` / `;ep=N`, of which only 1 is served yet). Syntax is checked where the setting is read
(no torch, no world); the world's size where the teacher is built (`check_world`)."""
from __future__ import annotations

# the sizes an option can name; pipeline and expert parallelism of a teacher are not served yet
SIZES = ("tp", "pp", "ep")
_UNSERVED = {"pp": "pipeline", "ep": "expert"}


def is_layout_option(option: str) -> bool:
    """Whether `option` (one `;`-separated piece, stripped) names a teacher layout size."""
    return option.partition("=")[0].strip() in SIZES and "=" in option


def layout_size(option: str, where: str) -> tuple[str, int]:
    """(name, size) of a `tp=N` / `pp=N` / `ep=N` option; ValueError naming `where` (the setting
    and its entry) for a value that is not a positive integer, or a pipeline / expert size > 1."""
    name, _, raw = option.partition("=")
    name, raw = name.strip(), raw.strip()
    size = int(raw) if raw.isdigit() else 0
    if size < 1:
        raise ValueError(f"{where}: option '{name}={raw}' must be a positive integer (the teacher's own "
                         f"{'tensor' if name == 'tp' else _UNSERVED[name]}-parallel size, e.g. ';{name}=2')")
    if name in _UNSERVED and size > 1:
        raise ValueError(f"{where}: option '{name}={size}': a teacher's own {_UNSERVED[name]}-parallel size is not "
                         "served yet (tensor parallelism is: ';tp=N'); drop it or use 1")
    return name, size


def check_world(tp: int, world_size: int, where: str) -> None:
    """ValueError naming `where` when a teacher at `tp` cannot be laid over `world_size` ranks."""
    if world_size % tp:
        raise ValueError(f"{where}: ';tp={tp}' cannot be laid over {world_size} rank(s): the world size must be "
                         f"a multiple of the teacher's tp; choose a tp that divides {world_size}")
