"""What each framework's door does with MEGATRON_RL_PATCHES_SHARED_PREFIX=1, decided in one place.

A door is where a framework's pass reads the setting (slime's passes, verl's engine, NeMo-RL's
policy) or where a hand-written megatron-core loop plans its micro-batches. For a framework, a
layout and a model config, the verdict is "shared", "packed whole, because ..." (one warning naming
what to change in that framework's own words) or, under MEGATRON_RL_PATCHES_STRICT=1, "refused,
because ..." (the same words as a ValueError on every rank):

- `frameworks`: each door's patch, passes and words (slime's `--no-rope-fusion`, verl's
  `actor_rollout_ref.model.use_remove_padding`, NeMo-RL's `policy.sequence_packing.enabled`);
- `table`: the layouts and model kinds x frameworks table (`FEATURES`) and the facts of a run
  (`Layout`) it is read at;
- `decision`: the verdict of a pass (`pass_verdict`) and the doors' one decision over the ranks
  (`agreed_decision`: gathered before the pass's first collective, the same on every rank).

The doors call `agreed_decision` at run time; docs/shared-prefix.md's matrix (`matrix_markdown`,
written by tools/doc_shared_prefix_matrix.py), `megatron-rl-patches doctor` and `megatron-rl-patches
shared-prefix check` read the same table."""
