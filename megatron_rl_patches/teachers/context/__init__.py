"""A privileged context the student does not see, in one room: the teacher's batch of context +
response (`teacher_context.py`: `with_context`, `context_ids`, `placed_before`), a teacher of another
tokenizer after its own context (`cross.py`), the key (`key.py`) and its owner
(`privileged.py`: `Privileged(teacher, KEY)`). The public names are
`megatron_rl_patches.teachers`'; this room hands none on."""
