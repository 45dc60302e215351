"""A teacher's own parallel layout as a setting writes it: the `;tp=N` / `;pp=N` options of a
MEGATRON_RL_PATCHES_OPD_TEACHERS entry or a MEGATRON_RL_PATCHES_INFERENCE_ROLES role (also
`;ep=N`, of which only 1 is served yet). Syntax is checked where the setting is read (no torch,
no world); the world's size where the teacher is built (`check_world`)."""
from __future__ import annotations

from megatron_rl_patches._digits import ascii_int

# the sizes an option can name; expert parallelism of a teacher is not served yet
SIZES = ("tp", "pp", "ep")
_KINDS = {"tp": "tensor", "pp": "pipeline", "ep": "expert"}
_UNSERVED = ("ep",)


def is_layout_option(option: str) -> bool:
    """Whether `option` (one `;`-separated piece, stripped) names a teacher layout size."""
    return option.partition("=")[0].strip() in SIZES and "=" in option


def layout_size(option: str, where: str) -> tuple[str, int]:
    """(name, size) of a `tp=N` / `pp=N` / `ep=N` option; ValueError naming `where` (the setting
    and its entry) for a value that is not a positive integer, or an expert size > 1."""
    name, _, raw = option.partition("=")
    name, raw = name.strip(), raw.strip()
    size = ascii_int(raw) or 0
    if size < 1:
        raise ValueError(f"{where}: option '{name}={raw[:40]}' must be a positive integer written in ASCII digits "
                         f"(the teacher's own "
                         f"{_KINDS[name]}-parallel size, e.g. ';{name}=2')")
    if name in _UNSERVED and size > 1:
        raise ValueError(f"{where}: option '{name}={size}': a teacher's own {_KINDS[name]}-parallel size is not "
                         "served yet (tensor and pipeline parallelism are: ';tp=N;pp=M'); drop it or use 1")
    return name, size


def written_sizes(tp: int | None, pp: int | None) -> str:
    """The layout options as an entry writes them: 'tp=2', 'pp=2' or 'tp=2;pp=2'."""
    return ";".join(f"{name}={size}" for name, size in (("tp", tp), ("pp", pp)) if size is not None)


def check_world(tp: int, world_size: int, where: str, pp: int = 1) -> None:
    """ValueError naming `where` when a teacher at `tp` x `pp` cannot be laid over `world_size` ranks."""
    if world_size % (tp * pp):
        sizes = f"tp={tp}" if pp == 1 else f"pp={pp}" if tp == 1 else f"tp={tp};pp={pp}"
        product = "the teacher's tp" if pp == 1 else f"the teacher's tp x pp = {tp * pp}"
        raise ValueError(f"{where}: ';{sizes}' cannot be laid over {world_size} rank(s): the world size must be "
                         f"a multiple of {product}; choose sizes whose product divides {world_size}")
