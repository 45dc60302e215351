"""The demo's progress bars draw on a terminal only: in redirected output (a CI log, `> file`)
tqdm's carriage returns became one long line per rollout."""
import io

from megatron_rl_patches.apps.demo import session


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(session.sys, "stderr", io.StringIO())
    bar = session._progress(3, "rollout 1/1", enabled=True)
    assert bar.disable
    bar.update(3)
    bar.close()
    assert session.sys.stderr.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr(session.sys, "stderr", terminal)
    bar = session._progress(3, "rollout 1/1", enabled=True)
    assert not bar.disable
    bar.update(3)
    bar.close()
    assert "rollout 1/1" in terminal.getvalue()
    assert session._progress(3, "x", enabled=False).disable
