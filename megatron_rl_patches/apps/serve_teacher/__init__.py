"""`megatron-rl-patches serve-teacher`: a teacher server on vLLM's engine held in process, answering the
routes `ServedTeacher` speaks (`app`) and computing a group's shared prefix once (`prefixes`,
`engine`). Nothing here imports vLLM until the command runs."""
