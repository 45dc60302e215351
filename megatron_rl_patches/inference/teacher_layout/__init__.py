"""A teacher at its own tensor-parallel layout over the student's ranks: `layout.TeacherLayout`
(the sizes), `groups.teacher_groups` (megatron-core process groups for them, built once),
`scoring.score_at_layout` (each rank's rows gathered into its teacher tensor-parallel group,
scored once, each rank's own log-probs returned); `megatron_rl_patches.inference` exports them.
See docs/layouts.md, "Teacher layout"."""
