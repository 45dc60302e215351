"""The teacher step of any loop, in one room: `TeacherStep` (`teacher_step.py`) and what it is
made of: the parts added before collect (`parts.py`, rows given instead of asked checked in
`given_rows.py`), the ranks' views of a step's teachers (`views.py`), their heads (`heads.py`), their
privileged contexts (`contexts.py`), the results shared as tensors (`share_tensors.py`), the
figures (`metrics.py`), and what a step takes from a served teacher's answer (`served.py`).
The public names are `megatron_rl_patches.teachers`'; this room hands none on."""
