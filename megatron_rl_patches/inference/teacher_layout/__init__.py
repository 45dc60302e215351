"""A teacher at its own tensor / pipeline-parallel layout over the student's ranks:
`layout.TeacherLayout` (the sizes), `groups.teacher_groups` (megatron-core process groups for
them in megatron-core's rank order, built once), `scoring.score_at_layout` / `topk_at_layout`
(each rank's rows gathered into its teacher replica, scored once, stage by stage at pp > 1 through
`pipeline.replica_scores`, each rank's own scores returned); `megatron_rl_patches.inference`
exports them. See docs/layouts.md, "Teacher layout"."""
