"""In-process teachers on megatron-core, for any Megatron host (slime today; Megatron-LM's own
loop and NeMo-RL's / verl's Megatron backends later): the teacher classes (`opd_teachers`, the
layout teacher, Hugging Face teachers, teachers with another tokenizer, served teachers' OPD
wrapper), their builders per kind (`teacher_builders.BUILDERS`) and the top-k OPD settings
(`opd_settings`). Nothing here imports slime nor `integrations.slime`: what a host's actor does
(switch a snapshot in, load one) the host supplies."""
