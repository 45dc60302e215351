"""PLACEHOLDER (lead): pass-through wrappers so the registry has real targets; the re-entrant-train
helper replaces this whole module."""


def _passthrough(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


enable_forward_pre_hook_wrapper = _passthrough
disable_forward_pre_hook_wrapper = _passthrough
train_wrapper = _passthrough
enable_hooks_helper_wrapper = _passthrough
disable_hooks_helper_wrapper = _passthrough
