"""The terminal's log lines (rich) reach the scrubbing of stdout whole: a line wrapped at
the terminal's width cut a secret in it, and each piece went on unscrubbed."""

from __future__ import annotations

import io

from rich.console import Console

from rlft.trainer.redaction import ScrubbedStream
from rlft.trainer.run.progress import Reporter
from rlft.trainer.secret_sources import secret_values

KEY = "judge-key-0f1e2d3c4b5a6978"


def test_a_log_line_on_a_narrow_terminal_is_scrubbed_whole_and_printed_as_written():
    under = io.StringIO()
    stream = ScrubbedStream(under, secret_values({"JUDGE_API_KEY": KEY}))
    reporter = Reporter(interactive=True)
    reporter.console = Console(file=stream, width=20, force_terminal=True, highlight=False)
    reporter.log(f"reward failed: [bold]{KEY}[/bold] at [1, 2]")
    stream.flush()
    assert KEY[:10] not in under.getvalue() and KEY[-10:] not in under.getvalue()
    assert "reward failed: [bold]***[/bold] at [1, 2]" in under.getvalue(), under.getvalue()
