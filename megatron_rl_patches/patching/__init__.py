"""Patch machinery: records, selection, start-up hook. Knows nothing of Megatron."""
