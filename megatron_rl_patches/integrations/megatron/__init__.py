"""megatron-core and Megatron-LM: their records (`patches`), the wrappers of DDP's hook toggles
and of the schedules (`core`), train() re-entry (`train_reentry`, shared with slime) and the
version range (`version`). The GPT `output_processor` backport works in
`megatron_rl_patches.processors.gpt_backport`; its record is declared here."""
