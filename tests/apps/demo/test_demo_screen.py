"""What the demo shows while it runs (issue 29, a new user's first minute): a line at once (not a
blank screen during the imports), each route's heading before its progress bars, bars counted in
steps. One real run of the plain route at its smallest size."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_rl_patches.apps.cli.demo import heading

pytestmark = [pytest.mark.megatron, pytest.mark.version_blind, pytest.mark.slow]  # the demo's screen: main lane only


def _read_all(fd: int) -> bytes:
    """Everything the child writes to its terminal, to its end (EIO once the child has closed it)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_line_at_once_then_the_heading_then_bars_in_steps():
    """On a terminal (a pseudo-terminal here: the bars are drawn on terminals only, issue 49)."""
    import fcntl
    import pty
    import struct
    import termios

    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    leader, follower = pty.openpty()
    # a terminal 120 columns wide: a new pty is 0 x 0, where tqdm draws bars of no width
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl_patches", "demo", "--route", "plain",
                             "--rollouts", "1", "--steps", "2"], env=environ, stdout=follower,
                            stderr=follower, stdin=subprocess.DEVNULL, close_fds=True)
    os.close(follower)
    first = os.read(leader, 1)
    first_after = time.perf_counter() - started
    rest = _read_all(leader)  # to the end: the run is bounded by its size (pytest's own timeout aside)
    os.close(leader)
    proc.wait(timeout=60)
    output = (first + rest).decode().replace("\r\n", "\n")
    assert proc.returncode == 0, output[-3000:]
    assert first_after < 3.0, f"nothing on screen for {first_after:.1f} s"
    assert output.startswith("starting megatron-core"), output[:200]
    title = heading("plain", 1)
    assert title in output and output.index(title) < output.index("rollout 1/1"), output[:2000]
    bars = [part for part in output.replace("\r", "\n").splitlines() if part.startswith("rollout 1/1")]
    assert bars and all("steps" in bar for bar in bars if "[" in bar), bars
    assert any("/2 " in bar for bar in bars), bars  # counted per optimizer step: 2 of them
