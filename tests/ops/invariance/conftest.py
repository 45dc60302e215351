import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "checks"))  # test_temperature_boundary's TP = 2 case
from invariance_worlds import Worlds  # noqa: E402


@pytest.fixture(scope="session")
def invariance_world():
    """`results(size, part)`: one world per size for every multi-rank check here (invariance_worlds)."""
    return Worlds()
