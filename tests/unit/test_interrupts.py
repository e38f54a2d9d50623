"""A Ctrl-C while `rlft train` imports torch: held back and raised after the imports.

Raised where it lands, it could land inside numpy's import, which torch's C++ start-up
runs and whose failure it clears: the interrupt was lost and the run trained to its end
(seen: `rlft train` given SIGINT 0.45 s after its start exited 0 after 150 steps). The
library below swallows every exception the way torch's start-up does."""

from __future__ import annotations

import builtins
import os
import signal
import threading
import time
import tomllib
from pathlib import Path

import pytest

from rlft.trainer.cli import entry
from rlft.trainer.cli.interrupts import InterruptedWhileStarting, deferred_interrupt


@pytest.fixture
def python_default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def library_that_clears_errors(swallowed: list[BaseException]) -> None:
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the handler runs here, between two bytecodes
    except BaseException as error:  # as torch clears a failed `import numpy`
        swallowed.append(error)


def test_without_the_guard_a_library_can_lose_a_ctrl_c(python_default_sigint):
    swallowed: list[BaseException] = []
    library_that_clears_errors(swallowed)
    assert [type(e) for e in swallowed] == [KeyboardInterrupt]  # and nothing else sees it


def test_a_ctrl_c_is_raised_after_the_block_not_inside_it(python_default_sigint):
    swallowed: list[BaseException] = []
    with pytest.raises(InterruptedWhileStarting), deferred_interrupt():
        library_that_clears_errors(swallowed)
        ran_on = True
    assert swallowed == [] and ran_on  # the block ran to its end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_no_ctrl_c_no_exception_and_the_handler_restored(python_default_sigint):
    with deferred_interrupt():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_commands_own_handler_is_left_alone(python_default_sigint):
    seen: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    with deferred_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
    assert seen == [signal.SIGINT]


def test_off_the_main_thread_it_changes_nothing(python_default_sigint):
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with deferred_interrupt():
                pass
        except BaseException as error:  # signal.signal would raise ValueError here
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == []


def test_the_rlft_command_starts_through_the_guarded_entry_point():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["rlft"] == "rlft.trainer.cli.entry:main"


def test_a_ctrl_c_while_the_command_line_imports_ends_in_one_line(monkeypatch, capsys):
    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "rlft.trainer.cli.main":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert entry.main() == 130
    assert capsys.readouterr().err == "rlft: stopped: SIGINT while starting; nothing had run\n"
