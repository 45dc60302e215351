"""A teacher's output layer on the trainer, in one room: `TeacherHead` (`teacher_head.py`), the
checkpoint it was read from (`fingerprint.py`), the engine's logits transforms (`transforms.py`),
a head re-cut to another vocabulary (`padding.py`), a `;head=DIR` entry's head on the host
(`for_host.py`), and a served teacher of another tokenizer's buckets exactly through it
(`cross_buckets.py`). The public names are `megatron_rl_patches.teachers`'; this room hands none on."""
