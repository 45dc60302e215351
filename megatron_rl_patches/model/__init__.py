"""What the package knows about a Megatron model, in one room every other room may use:

- `chunks`: one model or a list of model chunks, the `.module` chain of wrappers (Float16Module,
  DDP) and the one `unwrap`; every module of the chunks (`modules_of`); what counts as DDP;
- `kinds`: what a module is (a language model, an attention layer, the last pipeline stage);
- `arguments`: a call's arguments read and replaced by name (patches, wrappers, forward hooks);
- `attention_layout`: megatron-core's core-attention layout [s, b, heads, d] to torch SDPA's
  [b, heads, s, d] and back, grouped key / value heads included.

It imports nothing of the package (a floor below every room that uses it), torch only where a
module needs it, and megatron-core classes only through `sys.modules`: importing `chunks`,
`kinds` or `arguments` costs no torch (the patch machinery imports `arguments` at start-up)."""
