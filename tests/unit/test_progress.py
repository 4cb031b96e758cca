"""trainer/base/core/progress.py: sizes in words, and the line long work says once it is done."""
from __future__ import annotations

import time

from trainer.base.core import progress
from trainer.base.core.progress import SLOW_S, fmt_bytes, say_if_slow


def test_fmt_bytes():
    assert [fmt_bytes(n) for n in (0, 999, 1_000, 1_500_000, 12_884_901_744, -2e9)] == \
        ["0 B", "999 B", "1.0 kB", "1.5 MB", "12.9 GB", "-2.0 GB"]


def test_slow_work_is_said_once_done_and_quick_work_is_not(capsys, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    t0 = time.monotonic()
    now[0] += SLOW_S - 0.5
    say_if_slow(t0, lambda took: f"quick {took:.1f}")
    now[0] += 1.0
    say_if_slow(t0, lambda took: f"a save of 1.0 GB in {took:.1f} s")
    say_if_slow(t0, lambda took: "not this rank", speak=False)
    assert capsys.readouterr().err.splitlines() == [f"[trainer] a save of 1.0 GB in {SLOW_S + 0.5:.1f} s"]


def test_bar_counts_on_stderr_and_off_prints_notes_only(capsys):
    """progress.Bar: a tqdm bar on stderr (steps, bytes), or, disabled, no bar and notes as plain lines."""
    from trainer.base.core.progress import Bar

    off = Bar(10, "prepare", enabled=False)
    off.update(3, {"bad_rows": 1})
    off.note("a note")
    off.close()
    assert capsys.readouterr() == ("", "a note\n")
    on = Bar(10, "train W=1", unit="step", initial=2)
    on.update(1, {"loss": "0.5000"})
    assert on.bar.n == 3 and on.bar.postfix == "loss=0.5000"
    on.note("between")
    on.close()
    err = capsys.readouterr().err
    assert "between" in err and "train W=1" in err and "3/10" in err
