"""In-process on-policy distillation (OPD) on megatron-core, for any Megatron host (slime today;
Megatron-LM's own loop and NeMo-RL's / verl's Megatron backends later): the teacher classes
(`opd_teachers`, the layout teacher, Hugging Face teachers, teachers with another tokenizer, served
teachers' OPD wrapper), their builders per kind (`teacher_builders.BUILDERS`), the loss terms
(`opd_terms`) and the top-k OPD settings (`opd_settings`). Named for what it does (OPD in the
actor's process), not a second home of "teachers": the framework-free teacher contract and the
served wing are `megatron_rl_patches.teachers`. Nothing here imports slime nor
`integrations.slime`: what a host's actor does (switch a snapshot in, load one) the host supplies."""
