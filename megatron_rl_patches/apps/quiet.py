"""What the applications (demo, benchmarks) hide from their output: megatron-core's notes that
Transformer Engine / Apex are not installed (4-7 UserWarnings per import on a CPU machine) and
torch's FutureWarnings about renamed collectives. Our own warnings stay visible."""
from __future__ import annotations

import warnings


def hide_import_notes() -> None:
    """Ignore megatron-core's UserWarnings and torch.distributed's FutureWarnings in this process."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
