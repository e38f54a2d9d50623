"""`rlft scrubbed -- COMMAND`, what every pod's container runs first: COMMAND's output,
written by whatever process and however cut, reaches the log without the secrets of the
environment; signals go on to COMMAND and its exit code comes back (the operator's
failure policy reads it). Real processes: the console script, a Python child, a shell
grandchild."""

from __future__ import annotations

import contextlib
import io
import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlft.trainer.redaction import LineScrubber, ScrubbedStream
from rlft.trainer.secret_sources import secret_values

RLFT = str(Path(sys.executable).parent / "rlft")
KEY = "judge-key-0f1e2d3c4b5a"
ENV = dict(os.environ, JUDGE_API_KEY=KEY)

LEAKS = """
import os, sys, time
key = os.environ["JUDGE_API_KEY"]
os.write(1, f"fd: {key}\\n".encode())               # what a C library does
os.system("echo child: $JUDGE_API_KEY >&2")           # a process that is not rlft
sys.stdout.write("cut: " + key[:7]); sys.stdout.flush()
time.sleep(0.6)                                       # the pump's idle time passes
sys.stdout.write(key[7:] + " end\\n"); sys.stdout.flush()
sys.stdout.write("url: https://me:" + key[:3]); sys.stdout.flush()
time.sleep(0.6)
sys.stdout.write(key[3:] + "@judge.example/v1 end\\n")
os.write(1, b"bytes: \\xff\\xfe ok\\n")                # not UTF-8: passed on as it is
sys.stdout.write("last, no line end"); sys.stdout.flush()
sys.exit(3)
"""


def test_a_commands_output_reaches_the_log_without_secrets_however_it_is_written():
    ended = subprocess.run(
        [RLFT, "scrubbed", "--", sys.executable, "-c", LEAKS],
        env=ENV,
        capture_output=True,
        timeout=60,
    )
    out, err = ended.stdout, ended.stderr
    assert ended.returncode == 3, err  # the command's own exit code
    assert KEY.encode() not in out + err and KEY[:7].encode() not in out, (out, err)
    assert b"fd: ***\n" in out and b"child: ***\n" in err, (out, err)
    assert b"cut: *** end\n" in out, out
    assert b"url: https://***@judge.example/v1 end\n" in out, out
    assert b"bytes: \xff\xfe ok\n" in out, out
    assert out.endswith(b"last, no line end"), out


def test_signals_go_on_to_the_command_and_its_end_comes_back():
    waits = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('stopping', flush=True), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    process = subprocess.Popen(
        [RLFT, "scrubbed", "--", sys.executable, "-c", waits],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGTERM)  # a runtime's stop signal, to the first process
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 7 and out == "stopping\n", err
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    ended = subprocess.run([RLFT, "scrubbed", sys.executable, "-c", killed], timeout=60)
    assert ended.returncode == 128 + signal.SIGKILL  # as a runtime reports a kill


def test_a_command_that_cannot_run_is_named():
    ended = subprocess.run(
        [RLFT, "scrubbed", "--", "no-such-program-here"], capture_output=True, text=True
    )
    assert ended.returncode == 127
    assert "cannot run 'no-such-program-here'" in ended.stderr, ended.stderr
    ended = subprocess.run([RLFT, "scrubbed"], capture_output=True, text=True)
    assert ended.returncode == 2 and "usage: rlft scrubbed -- COMMAND" in ended.stderr
    helped = subprocess.run([RLFT, "scrubbed", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "without the secrets" in helped.stdout, helped.stdout


def test_the_output_of_a_command_that_leaves_processes_behind_ends_with_it():
    """A daemon it started keeps the pipes open (as Ray's do): the command's end still ends
    `rlft scrubbed` within the drain time, with the command's output passed on."""
    leaves = "import subprocess; print(subprocess.Popen(['sleep', '60']).pid, flush=True)"
    started = time.monotonic()
    ended = subprocess.run(
        [RLFT, "scrubbed", "--", sys.executable, "-c", leaves],
        capture_output=True,
        text=True,
        timeout=60,
    )
    left = int(ended.stdout.split()[0]) if ended.stdout.strip().isdigit() else None
    try:
        assert ended.returncode == 0 and left is not None, (ended.stdout, ended.stderr)
        assert time.monotonic() - started < 20
    finally:
        if left is not None:
            os.kill(left, signal.SIGKILL)


def test_a_line_that_never_ends_still_flows():
    """A partial line goes on once it has waited a moment, also while more of it keeps
    coming (a dot a tenth of a second: never quiet long enough)."""
    dots = (
        "import sys, time\n"
        "for _ in range(40):\n"
        "    sys.stdout.write('.'); sys.stdout.flush(); time.sleep(0.1)\n"
        "print('end')\n"
    )
    started = time.monotonic()
    process = subprocess.Popen(
        [RLFT, "scrubbed", "--", sys.executable, "-c", dots],
        env=ENV,
        stdout=subprocess.PIPE,
        bufsize=0,  # read(1) reads one byte, none ahead that communicate() would miss
    )
    try:
        first = process.stdout.read(1)
        seen_after = time.monotonic() - started
        rest = process.communicate(timeout=60)[0]
    finally:
        process.kill()
        process.wait()
    assert first == b"." and rest == b"." * 39 + b"end\n", rest
    assert seen_after < 3.5, f"the first dot came {seen_after:.1f} s after the start"


def _on_a_terminal(argv: list[str], ctrl_c_after: bytes | None = None) -> bytes:
    """What `argv` prints run in a pseudo-terminal's foreground process group (as from a
    shell), with Ctrl-C typed once `ctrl_c_after` was printed."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child: a session of its own, the pty its controlling terminal
        os.execve(argv[0], argv, ENV)
    seen = b""
    try:
        while ctrl_c_after is not None and ctrl_c_after not in seen:
            seen += os.read(terminal, 1024)
        if ctrl_c_after is not None:
            os.write(terminal, b"\x03")
        with contextlib.suppress(OSError):  # EIO once the child has ended
            while chunk := os.read(terminal, 1024):
                seen += chunk
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(terminal)
    return seen


def test_ctrl_c_on_a_terminal_reaches_the_command_once():
    """The terminal sends Ctrl-C to its whole foreground process group, the command
    included: passed on as well, it could come twice (a second Ctrl-C stops `rlft train`
    at once, without its checkpoint). A runtime's signals, with no terminal, go on."""
    counts = (
        "import signal, time\n"
        "seen = []\n"
        "signal.signal(signal.SIGINT, lambda *_: seen.append(1))\n"
        "print('ready', flush=True)\n"
        "time.sleep(2)\n"
        "print('SIGINTs', len(seen), flush=True)\n"
    )
    seen = _on_a_terminal([RLFT, "scrubbed", "--", sys.executable, "-c", counts], b"ready")
    assert re.search(rb"SIGINTs (\d)", seen).group(1) == b"1", seen
    asks = (
        "import signal\n"
        "from rlft.trainer.cli.scrubbed import _from_the_terminal as sent\n"
        "print('sent by the terminal:', sent(signal.SIGINT), sent(signal.SIGTERM))\n"
    )
    assert b"sent by the terminal: True False" in _on_a_terminal([sys.executable, "-c", asks])
    alone = subprocess.run(
        [sys.executable, "-c", asks],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        start_new_session=True,
        timeout=60,
    )
    assert b"sent by the terminal: False False" in alone.stdout, alone.stderr


def test_a_partial_line_waits_where_a_secret_may_be_cut():
    scrubber = LineScrubber(secret_values({"JUDGE_TOKEN": "tok-0123456789"}), words=True)
    assert scrubber.lines("key tok-01") == ""
    assert scrubber.partial() == "key "  # `tok-01` may begin the secret
    assert scrubber.lines("23456789 and https://me:pw") == ""
    assert scrubber.partial() == "*** and "  # a URL's credentials not ended yet
    assert scrubber.lines("@host/x\n") == "https://***@host/x\n"
    assert scrubber.lines("a prompt: ") == "" and scrubber.partial() == "a prompt: "
    assert scrubber.lines("done") == "" and scrubber.rest() == "done"
    # A cut anywhere in a URL's scheme, or inside a secret that ends as it begins, or
    # in one with a space: each is found whole.
    assert scrubber.lines("see https") == "" and scrubber.partial() == "see "
    assert scrubber.lines("://me:pw@host/x\n") == "https://***@host/x\n"
    secrets = secret_values({"A_TOKEN": "a1b2c3d4e5a", "B_PASSWORD": "correct horse"})
    ends_as_it_begins = LineScrubber(secrets)
    assert ends_as_it_begins.lines("key a1b2c3d4e5a") == ""
    assert ends_as_it_begins.partial() == "key ***"
    with_a_space = LineScrubber(secrets, words=True)
    assert with_a_space.lines("token a1b2c3d4e5a pw correct horse") == ""
    assert with_a_space.partial() == "token *** pw ***"
    # Without `words` (a terminal's stream: a progress bar keeps its last column)...
    stream_scrubber = LineScrubber(secret_values({"JUDGE_TOKEN": "tok-0123456789"}))
    stream_scrubber.lines("0:00:05 https://me:pw")
    assert stream_scrubber.partial() == "0:00:05 https://me:pw"
    # ...a secret cut by a flush still waits, in a ScrubbedStream too.
    under = io.StringIO()
    stream = ScrubbedStream(under, secret_values({"JUDGE_TOKEN": "tok-0123456789"}))
    stream.write("key tok-0123")
    stream.flush()
    assert under.getvalue() == "key "
    stream.write("456789\n")
    assert under.getvalue() == "key ***\n"
    stream.write("tail tok-")
    stream.finish()  # at exit: what is left goes
    assert under.getvalue() == "key ***\ntail tok-"
