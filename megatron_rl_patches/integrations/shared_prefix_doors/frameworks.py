"""The frameworks whose passes share a group's prompt, each in its own words: the patch the setting
takes effect through, the passes it covers, and how its users change a model config field (slime's
Megatron arguments, verl's `override_transformer_config`, NeMo-RL's `policy.megatron_cfg`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl_patches.settings import SHARED_PREFIX

SLIME, VERL, NEMO_RL, MEGATRON = "slime", "verl", "nemo-rl", "megatron"


@dataclass(frozen=True)
class Framework:
    """A door: `key` (the CLI's --framework word), `title` (how the docs name it), `patch` (the patch the
    setting takes effect through; None: a loop that calls the package itself), the passes that share,
    and the framework's words for a model config field: `fields` where it has a word of its own, else
    `generic` (formatted with the field's name)."""

    key: str
    title: str
    patch: str | None
    passes: tuple[str, ...]
    generic: str
    fields: dict[str, str] = field(default_factory=dict)

    def change(self, name: str) -> str:
        """What a user of this framework changes for the config field `name`."""
        return self.fields.get(name) or self.generic.format(field=name)


VERL_OVERRIDE = "+actor_rollout_ref.actor.megatron.override_transformer_config"
NEMO_MEGATRON = "policy.megatron_cfg"

FRAMEWORKS: dict[str, Framework] = {
    SLIME: Framework(
        SLIME, "slime", "slime_fused",
        ("training step", "old log-probs", "reference log-probs", "in-process teachers"),
        generic="Megatron's argument for {field} (--{field}, dashed) in the run script",
        fields={
            "apply_rope_fusion": "--no-rope-fusion",
            "rotary_interleaved": "drop --rotary-interleaved",
            "context_parallel_size": "--context-parallel-size 1",
            "virtual_pipeline_model_parallel_size": "drop --num-virtual-stages-per-pipeline-rank "
                                                    "(--num-layers-per-virtual-pipeline-stage)",
            "moe_enable_routing_replay": "drop --use-rollout-routing-replay and --use-routing-replay",
            "moe_expert_capacity_factor": "drop --moe-expert-capacity-factor",
            "mtp_num_layers": "--mtp-num-layers 2 or fewer",
            "attention_dropout": "--attention-dropout 0",
            "hidden_dropout": "--hidden-dropout 0",
            "moe_input_jitter_eps": "drop --moe-input-jitter-eps",
        }),
    VERL: Framework(
        VERL, "verl 0.9 (its Megatron engine)", "verl_fused_logprobs",
        ("training step", "old log-probs", "reference log-probs"),
        generic=VERL_OVERRIDE + ".{field}=... (the actor's; the reference takes the actor's overrides)",
        fields={
            "apply_rope_fusion": f"{VERL_OVERRIDE}.apply_rope_fusion=False",
            "rotary_interleaved": f"{VERL_OVERRIDE}.rotary_interleaved=False",
            "context_parallel_size": "actor_rollout_ref.actor.megatron.context_parallel_size=1",
            "virtual_pipeline_model_parallel_size": "actor_rollout_ref.actor.megatron."
                                                    "virtual_pipeline_model_parallel_size=null",
            "moe_enable_routing_replay": "actor_rollout_ref.actor.megatron.router_replay.mode=disabled",
            "mtp_num_layers": "actor_rollout_ref.model.mtp.enable_train=False",
            "attention_dropout": f"{VERL_OVERRIDE}.attention_dropout=0.0",
            "hidden_dropout": f"{VERL_OVERRIDE}.hidden_dropout=0.0",
        }),
    NEMO_RL: Framework(
        NEMO_RL, "NeMo-RL (its Megatron policy)", "nemo_rl_shared_prefix",
        ("training step", "log-probs (the policy's and the reference's)", "a distillation teacher's top-k"),
        generic="the model's {field} (Megatron-Bridge's model provider)",
        fields={
            "apply_rope_fusion": f"{NEMO_MEGATRON}.apply_rope_fusion=false",
            "context_parallel_size": f"{NEMO_MEGATRON}.context_parallel_size=1",
            "pipeline_model_parallel_size": f"{NEMO_MEGATRON}.pipeline_model_parallel_size=1",
            "virtual_pipeline_model_parallel_size": f"{NEMO_MEGATRON}.virtual_pipeline_model_parallel_size=null",
            "moe_enable_routing_replay": "policy.router_replay.enabled=false",
            "mtp_num_layers": f"{NEMO_MEGATRON}.mtp_num_layers=0",
        }),
    MEGATRON: Framework(
        MEGATRON, "a hand-written megatron-core loop", None, ("every pass whose forward step plans its micro-batch",),
        generic="the model config's {field}",
        fields={
            "apply_rope_fusion": "config.apply_rope_fusion=False",
            "variable_seq_lengths": "config.variable_seq_lengths=True",
            "virtual_pipeline_model_parallel_size": "config.virtual_pipeline_model_parallel_size=None",
            "moe_enable_routing_replay": "config.moe_enable_routing_replay=False",
            "context_parallel_size": "config.context_parallel_size=1",
        }),
}
OFF = f"{SHARED_PREFIX}=0"  # every framework's switch: the job runs each sample packed whole, without a warning


def framework(key: str) -> Framework:
    """The framework named `key` (slime, verl, nemo-rl, megatron); a ValueError naming the choices."""
    found = FRAMEWORKS.get(key)
    if found is None:
        raise ValueError(f"framework={key!r} is not one the shared-prefix table knows: use one of "
                         f"{', '.join(FRAMEWORKS)}")
    return found
