"""`rlft train --nproc`'s torchrun command line."""

from __future__ import annotations

import signal

from rlft.trainer.distributed.launch import _SignalRelay, torchrun_command


def test_torchrun_waits_the_jobs_grace_for_its_workers_before_killing_them():
    """Its own default is 30 s: an emergency checkpoint with a longer grace was cut off."""
    command = torchrun_command(2, "rlft.trainer.cli.main", ["train"], "/tmp/logs", 45.2)
    assert "--shutdown-timeout=46" in command
    assert command.index("--shutdown-timeout=46") < command.index("-m", 3)  # torchrun's own


def test_without_a_grace_torchrun_keeps_its_default():
    command = torchrun_command(2, "rlft.trainer.cli.main", ["train"], "/tmp/logs")
    assert not any(part.startswith("--shutdown-timeout") for part in command)


def test_a_hangup_the_process_ignores_stays_ignored():
    """`nohup rlft train --nproc 2`: the hangup nohup ignores must not stop the run."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _SignalRelay() as relay:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == relay._handle  # relayed
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
