"""verl (0.9.x): its records (`patches`); its Megatron engine's fused log-prob route (`fused`,
reading only the rows verl reads: `rows`) and its top-k distillation loss (`topk`)."""
