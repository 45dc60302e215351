"""NeMo-RL (7ea279ab): its records (`patches`); its Megatron driver's log-prob route on the fused
head (`logprobs`), its teacher top-k on the package's top-k (`topk`) and its top-k distillation
loss as the exact (k+1)-bucket divergence (`topk_kd`), each through one forward step (`step`)
and NeMo-RL's own row layouts (`rows`)."""
