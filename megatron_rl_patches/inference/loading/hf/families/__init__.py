"""The Hugging Face model families the converter serves, registered in one table: `FAMILIES`
(one module each, see `family.py` for what a family says), `family_for(model_type)`, and
config.json -> its family -> its HFArchitecture. Adding a family is a module here and a row below.

A family module (`llama.py`, `qwen2.py`, `qwen3.py`, `qwen3_moe.py` show the size: 20-40 lines) holds a
`Family`: its `model_type`; how its config.json becomes an `HFArchitecture` and what it refuses
(`read`, on `architecture.decoder_architecture`); its tensors per layer (`{e}` in a per-expert name);
each Megatron local-spec parameter's Hugging Face tensors and fuse kind (`Param`, with a `FuseKind`
of `common_kinds.py`: REPLICATE, ROW, COLUMN, GATED, QKV, VOCAB, ...); its `TransformerConfig`
overrides, layer spec and model class (default: megatron-core's local GPT spec and `GPTModel`); its
parallel-size checks; whether `converter="mbridge"` serves it; the tensor prefixes the loader skips
(`skipped`: MTP layers, by default the `num_nextn_predict_layers` after the decoder layers); and the
fields of the test kit's tiny config. What several families share (attention, SwiGLU, routed and
shared experts) is in `common.py`; RoPE, plain or scaled, is read for every family by
`rope_scaling.py`. A family or feature slime or verl train that is not served gets its reason in
`REFUSED` below and a row of docs/inference-only.md's family table.

Registered here, the loader, the converter, the memory plan (one formula over the fuse kinds), the
mbridge route, the OPD teachers' loading and `testing.hf_checkpoints` read it. The family contract
(`contract.py`, run on every registered family by tests/inference/loading/hf/test_families_contract.py)
checks each layer tensor makes exactly one parameter and the memory plan counts what the checkpoint
holds, and builds each on CPU; test_hf_reference.py adds its forward against transformers'. Then
`python tools/doc_families.py` writes the new `model_type` into the docs' lists of families."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches import _aliases
from megatron_rl_patches.inference.loading.hf.architecture import (
    HFArchitecture,
    UnsupportedCheckpointError,
    refuse_rope_scaling,
)
from megatron_rl_patches.inference.loading.hf.checkpoint_config import read_checkpoint_config
from megatron_rl_patches.inference.loading.hf.families import (
    deepseek_v3,
    glm4_moe,
    glm4_moe_lite,
    llama,
    mimo,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
)
from megatron_rl_patches.inference.loading.hf.families.family import Family

FAMILIES: tuple[Family, ...] = (qwen3.FAMILY, qwen3_moe.FAMILY, llama.FAMILY, qwen2.FAMILY, glm4_moe.FAMILY,
                                 qwen2_moe.FAMILY, mixtral.FAMILY, mimo.FAMILY,
                                 deepseek_v3.FAMILY, glm4_moe_lite.FAMILY, qwen3_5.FAMILY, qwen3_5.TEXT_FAMILY,
                                 qwen3_5.MOE_FAMILY, qwen3_5.MOE_TEXT_FAMILY, qwen3_next.FAMILY)
REGISTRY: dict[str, Family] = {model_type: family for family in FAMILIES for model_type in family.model_types}
# families slime or verl train that the converter does not serve, and why (docs/inference-only.md lists them)
REFUSED: dict[str, str] = {
    "glm4": "GLM-4 dense adds norms after attention and after the MLP that megatron-core's GPT layer lacks",
    "glm_moe_dsa": "GLM-5's sparse attention runs on GPU kernels only",
    "minimax_m2": "MiniMax-M2 normalizes queries and keys over all heads at once, not per head",
    "gpt_oss": "gpt-oss has attention sinks, alternating sliding windows and clamped SwiGLU experts with biases",
}


def family_for(model_type: Any, source: str = "config.json", architectures: Any = None) -> Family:
    """The family of a config.json's `model_type`; UnsupportedCheckpointError naming it otherwise."""
    family = REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if family is None and isinstance(model_type, str) and model_type in REFUSED:
        raise UnsupportedCheckpointError(
            f"{source}: model_type {model_type!r} is not served by the Hugging Face converter: "
            f"{REFUSED[model_type]}; build this teacher with build_inference_model and your own model provider"
        )
    if family is None:
        raise UnsupportedCheckpointError(
            f"{source}: model_type {model_type!r} (architectures {architectures}) is not served "
            f"by the Hugging Face converter, which maps {', '.join(sorted(REGISTRY))}; build this teacher with "
            "build_inference_model and your own model provider"
        )
    return family


def architecture(config: dict[str, Any], source: str = "config.json", *, sizing: bool = False) -> HFArchitecture:
    """An HFArchitecture from a config.json dict, read by its family; UnsupportedCheckpointError
    naming the family or the feature the converter does not map. `sizing`: for the memory planner,
    which counts bytes: a feature that changes none (RoPE scaling) is kept in the record, not refused."""
    family = family_for(config.get("model_type"), source, config.get("architectures"))
    arch = family.architecture(config, source)  # the one lookup: the build's modules take `arch.family`
    if not sizing:
        refuse_rope_scaling(arch)
    return arch


def read_architecture(path: Any, argument: str = "path", *, sizing: bool = False) -> HFArchitecture:
    """The architecture of the checkpoint directory `path` (its config.json read by
    `read_checkpoint_config`, as every entry point reads it)."""
    return architecture(read_checkpoint_config(path, argument).fields, source=str(path), sizing=sizing)


def split_problems(arch: HFArchitecture, tp: int = 1, pp: int = 1, ep: int = 1, vpp: int = 1) -> list[str]:
    """What a tensor / pipeline (x virtual) / expert parallel layout cannot split of `arch`: the
    one check of the builder and of the memory planner (`memory --hf`), so neither plans a layout
    the other refuses."""
    problems = arch.family.parallel_problems(arch, tp, ep)
    if arch.num_layers % (pp * vpp):
        stages = f"the pipeline-parallel size {pp}" + (f" x {vpp} virtual stages" if vpp > 1 else "")
        problems.append(f"num_hidden_layers={arch.num_layers} is not a multiple of {stages}")
    return problems


# the family contract checks the memory plan and the tensor names too: it sits beside them, in loading/hf/
_aliases.install(__name__, {"contract": "megatron_rl_patches.inference.loading.hf.contract"})
