"""megatron_ds.progress: a tqdm bar on terminals, plain lines with an ETA in logs."""
from __future__ import annotations

import io

from megatron_ds.progress import LineProgress, progress, track


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_redirected_output_gets_lines_without_carriage_returns():
    out = io.StringIO()
    with progress(total=10, desc="evaluate", unit="tokens", stream=out, log_interval=0.0) as bar:
        assert isinstance(bar, LineProgress)
        for _ in range(5):
            bar.update(2)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 6  # one per update (interval 0 here), one at the end
    assert lines[0].startswith("evaluate: 2/10 tokens (20%) |") and "ETA" in lines[0]
    assert lines[-1].startswith("evaluate: 10/10 tokens (100%)")


def test_interval_limits_the_lines():
    out = io.StringIO()
    with progress(total=1000, desc="x", stream=out, log_interval=3600) as bar:
        for _ in range(1000):
            bar.update()
    assert len(out.getvalue().splitlines()) == 1  # only the final line


def test_terminal_gets_a_tqdm_bar_and_disabled_is_silent():
    from tqdm import tqdm

    tty = _Tty()
    bar = progress(total=3, desc="x", stream=tty)
    assert isinstance(bar, tqdm)
    bar.update(3)
    bar.close()
    assert "\r" in tty.getvalue()
    quiet = io.StringIO()
    with progress(total=3, stream=quiet, enabled=False) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""


def test_track_yields_every_item_and_reports_the_count():
    out = io.StringIO()
    assert list(track(iter("abcd"), 4, "export", unit="layers", stream=out, log_interval=3600)) == list("abcd")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export: 4/4 layers (100%)")  # the interval is 1 h: only the end
