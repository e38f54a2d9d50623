"""The `rlft` command's entry point: imports the command line inside a guard, so a
Ctrl-C in the first fraction of a second (while Python imports it, before any command
has installed its handlers) ends with one line and 128 + SIGINT instead of a traceback.
Nothing else is imported here: the window it leaves is Python's own start-up. `rlft
scrubbed`, what every pod runs first, imports only its own module (scrubbed.py)."""

from __future__ import annotations

import sys

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
STOPPED_STARTING = "rlft: stopped: SIGINT while starting; nothing had run"


def main() -> int:
    try:
        if sys.argv[1:2] == ["scrubbed"]:  # every pod's first process: nothing more to import
            from rlft.trainer.cli.scrubbed import main as run_scrubbed

            return run_scrubbed(sys.argv[2:])
        from rlft.trainer.redaction import scrub_output

        scrub_output()
        from rlft.trainer.cli.main import main as run
    except KeyboardInterrupt:
        print(STOPPED_STARTING, file=sys.stderr)
        return INTERRUPTED
    return run()
