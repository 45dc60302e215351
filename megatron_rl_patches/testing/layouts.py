"""The parallel layouts of docs/layouts.md, each declared once: its id, `layout(...)` marker, ranks,
parallel sizes and what runs. Test worlds, markers and the page's layout table are built from (or
checked against) this table, so a layout's identity lives in one place and a marker typo fails."""
# lazy imports: optional dependency pytest
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Megatron-LM's argv (slime's lane) of the tiny MoE student at EP=2: 4 experts, top-2, no
# load-balancing loss, no biases (megatron-core's MoE layers have none).
EP2_ARGS = ("--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--moe-ffn-hidden-size", "64", "--moe-router-load-balancing-type", "none", "--disable-bias-linear")
# No positional embedding: megatron-core's thd RoPE cuts each sequence in zigzag, so a contiguous
# (allgather) context-parallel model brings its own positions or none.
NOPE_ARGS = ("--position-embedding-type", "none")
ALLGATHER_CP_ARGS = ("--allgather-cp", *NOPE_ARGS)


@dataclass(frozen=True)
class Layout:
    """One column of docs/layouts.md: the world a test spawns for it and the marker it carries."""

    id: str  # the page's column id, "L1"
    title: str  # the page's name, "TP"
    marker: str  # the `layout(...)` marker name, "tp2"
    runs: str  # what runs (the page's last column)
    ranks: int = 1  # gloo ranks of the smallest world that shows it
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual stages per pipeline stage
    cp: int = 1
    ep: int = 1
    cp_layout: str | None = None  # "zigzag" or "contiguous" (testing.cp_layout.LAYOUTS)
    megatron_lm_args: tuple[str, ...] = ()  # Megatron-LM's argv for the layout (slime's lane) beyond the sizes

    @property
    def world(self) -> dict[str, Any]:
        """`megatron_world` / `run_in_megatron_world` keywords of the layout's parallel sizes."""
        sizes = {"tensor_parallel": self.tp, "pipeline_parallel": self.pp, "virtual_pipeline": self.vpp,
                 "context_parallel": self.cp, "expert_parallel": self.ep}
        return {key: value for key, value in sizes.items() if value not in (None, 1)}

    def row(self) -> str:
        """The layout's row of docs/layouts.md's layout table."""
        return f"| {self.id} | {self.title} | `{self.marker}` | {self.runs} |"


LAYOUTS: tuple[Layout, ...] = (
    Layout("L1", "TP", "tp2", "tensor parallelism 2 (vocabulary-parallel output layer)", ranks=2, tp=2),
    Layout("L2", "SP", "sp", "sequence parallelism on top of TP 2", ranks=2, tp=2,
           megatron_lm_args=("--sequence-parallel",)),
    Layout("L3", "PP", "pp2", "pipeline parallelism 2 through megatron-core's schedule", ranks=2, pp=2),
    Layout("L4", "VPP", "vpp2", "PP 2 x 2 virtual stages (interleaved schedule)", ranks=2, pp=2, vpp=2),
    Layout("L5", "CP zigzag", "cp2-zigzag", "context parallelism 2, rank r holds chunks r and 2cp-1-r", ranks=2,
           cp=2, cp_layout="zigzag"),
    Layout("L6", "CP allgather", "cp2-allgather", "context parallelism 2, contiguous slices (slime's --allgather-cp)",
           ranks=2, cp=2, cp_layout="contiguous", megatron_lm_args=ALLGATHER_CP_ARGS),
    Layout("L7", "EP/MoE", "ep2", "MoE, expert parallelism 2 (allgather dispatcher)", ranks=2, ep=2,
           megatron_lm_args=EP2_ARGS),
    Layout("L8", "MTP", "mtp", "multi-token prediction heads"),
    Layout("L9", "thd", "thd", "packed sequences with cu_seqlens"),
    Layout("L10", "bshd", "bshd", "[b, s] batches"),
    Layout("L11", "bf16", "bf16", "bf16 parameters (Float16Module)", megatron_lm_args=("--bf16",)),
    Layout("L12", "dist-opt", "distopt", "distributed optimizer (DP 2, sharded state)", ranks=2,
           megatron_lm_args=("--use-distributed-optimizer",)),
    Layout("L13", "recompute", "recompute", "activation recompute (full, uniform)",
           megatron_lm_args=("--recompute-granularity", "full", "--recompute-method", "uniform",
                             "--recompute-num-layers", "1")),
    Layout("L14", "Hybrid", "hybrid", "HybridModel (megatron-core >= 0.18)"),
)
BY_MARKER: dict[str, Layout] = {layout.marker: layout for layout in LAYOUTS}
BY_ID: dict[str, Layout] = {layout.id: layout for layout in LAYOUTS}
# Marker names of model forms a test may add beside its layouts (no column of their own).
FORMS: dict[str, str] = {"moe": "an MoE model (any expert parallelism)", "ep1": "MoE at expert parallelism 1",
                         "rope": "rotary position embeddings"}


def check_names(names: tuple[str, ...] | list[str]) -> None:
    """Refuse marker names that are neither a layout of the table nor a model form."""
    unknown = [name for name in names if name not in BY_MARKER and name not in FORMS]
    if unknown or not names:
        raise ValueError(f"layout marker names {unknown or '(none)'} are unknown: use the markers of "
                         f"megatron_rl_patches.testing.layouts ({', '.join([*BY_MARKER, *FORMS])})")


def mark(*names: str) -> Any:
    """`pytest.mark.layout(*names)` after checking every name against the table (a typo raises)."""
    import pytest

    check_names(names)
    return pytest.mark.layout(*names)


def marker_problems(items: list[Any]) -> list[str]:
    """Collected pytest items whose `layout(...)` markers name no known layout or form."""
    problems = []
    for item in items:
        for marker in item.iter_markers("layout"):
            try:
                check_names(marker.args)
            except ValueError as exc:
                problems.append(f"{item.nodeid}: {exc}")
    return problems


def markdown_table() -> str:
    """docs/layouts.md's layout table, as the table in code writes it."""
    rows = [layout.row() for layout in LAYOUTS]
    return "\n".join(["| id | layout | marker | what runs |", "|---|---|---|---|", *rows])
