"""Weights-only loading for frozen builds: `weights` (load_inference_weights: a torch_dist
checkpoint or a torch state-dict file), `torch_dist` (megatron-core's sharded read without the
common state), `paths` (where a checkpoint's weights are), `errors` (the errors and the model-fit
check). Hugging Face directories: `hf/` (build_inference_model_from_hf, its converter and memory plan)."""
