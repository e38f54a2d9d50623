"""A trainer's error text is scrubbed of the secrets in its environment before it is
printed and before it becomes the verdict the operator copies into the job's status: a
reward calling a judge with its key in the URL failed with the library's error, which
quoted the URL, key and all. Both sides are real: `rlft train` fails, and the
operator's own reading of the pod's termination message makes the failure it reports.
What else the process prints (a reward's own prints and logging) is scrubbed too."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_resume import start, write_job

from rlft.operator import failures
from rlft.operator import names as N
from rlft.operator.observe import pod_view
from rlft.trainer.redaction import ScrubbedStream, scrubbed
from rlft.trainer.secret_sources import secret_values

KEY = "judge-key-0f1e2d3c4b5a"
SESSION = "aws-session-9a8b7c6d5e"

JUDGE = """
import logging
import os
import sys


def judge(completion, answer):
    key = os.environ["JUDGE_API_KEY"]
    print("calling the judge with", key)
    sys.stderr.write(f"retrying https://judge.example/v1?token={key[:6]}")  # in two pieces
    sys.stderr.write(f"{key[6:]} after 1s\\n")
    logging.getLogger("judge").warning("judge session %s", os.environ["AWS_SESSION_TOKEN"])
    raise ConnectionError(
        f"Max retries exceeded with url: /v1/judge?api_key={key} "
        f"(https://user:{key}@judge.example/v1) session {os.environ['AWS_SESSION_TOKEN']}"
    )
"""


def test_a_rewards_error_reaches_the_log_and_the_jobs_status_without_its_secrets(tmp_path):
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["reward"] = {"functions": [{"name": "judge_reward:judge"}]}
    spec["spec"]["algorithm"]["sft"] = {"steps": 0}
    job.write_text(yaml.safe_dump(spec))
    (tmp_path / "judge_reward.py").write_text(JUDGE)
    env = {"JUDGE_API_KEY": KEY, "AWS_SESSION_TOKEN": SESSION, "RLFT_SECRET_ENV": "JUDGE_API_KEY"}
    process = start(tmp_path, "out", env=env)
    output = process.communicate(timeout=300)[0]
    assert process.returncode != 0, output
    assert "judge_reward:judge" in output and "ConnectionError" in output, output
    assert "calling the judge with ***" in output and "judge session ***" in output, output
    assert "v1?token=*** after 1s" in output, output
    assert KEY not in output and SESSION not in output, output
    message = (tmp_path / "out.termination").read_text()
    assert "api_key=***" in message and "***@judge.example" in message, message
    failure = failures.classify(pod_view(ended_trainer_pod(1, message)))
    assert failure is not None and "judge_reward:judge" in failure.message
    assert KEY not in failure.message and SESSION not in failure.message


def ended_trainer_pod(exit_code: int, message: str) -> dict:
    """A trainer pod whose container ended with `exit_code` and the termination message
    `message`, as the kubelet reports it to the API server (what the operator reads)."""
    terminated = {"exitCode": exit_code, "reason": "Error", "message": message}
    return {
        "metadata": {
            "name": "tiny-grpo-trainer-0",
            "uid": "u1",
            "labels": {N.LABEL_ROLE: N.ROLE_TRAINER, N.LABEL_INDEX: "0"},
        },
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "main", "state": {"terminated": terminated}}],
        },
    }


def test_variables_named_as_secrets_are_scrubbed_whoever_set_them():
    """`envFrom` puts a Secret's keys in the environment under their own names, which the
    operator never sees (it does not read Secrets): they are scrubbed by name."""
    environ = {
        "OPENAI_API_KEY": "sk-0123456789",
        "JUDGE_TOKEN": "tok-0123456789",
        "DB_PASSWORD": "pw-0123456789",
        "my_secret": "lower-0123456789",
        "TOKENIZERS_PARALLELISM": "false-but-long",
        "KEYCLOAK_REALM": "realm-0123456789",
        "MONKEY": "banana-0123456789",
        "GITHUB_PAT": "ghp-0123456789",
        "SENTRY_DSN": "https://k0123456789@o1.ingest/1",
        "SLACK_WEBHOOK_URL": "https://hooks/T0/B0/x0123456789",
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20otel-9876543210",
        "LD_LIBRARY_PATH": "/usr/local/lib/x",
        "PATCH_LEVEL": "patch-0123456789",
        # Where secrets are, or which variables hold them: naming them is no leak.
        "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks/token",
        "SECRETS_DIR": "/var/run/secrets",
        "RLFT_SECRET_ENV": "JUDGE_TOKEN,OTHER_ONE",
        "SSH_PUBLIC_KEY": "ssh-ed25519 AAAAC3Nz",
    }
    text = " ".join(environ.values())
    assert scrubbed(text, environ) == (
        "*** *** *** *** false-but-long realm-0123456789 banana-0123456789 *** *** *** *** "
        "/usr/local/lib/x patch-0123456789 "
        "/var/run/secrets/eks/token /var/run/secrets JUDGE_TOKEN,OTHER_ONE ssh-ed25519 AAAAC3Nz"
    )


def test_each_header_of_an_otlp_header_list_is_scrubbed_as_an_exporter_shows_it():
    """OTLP exporters take `k=v,k2=v2` with URL-encoded values; their errors and debug
    logs show one header at a time, decoded."""
    environ = {
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": (
            "Authorization=Bearer%20otlp-0123456789, x-api-key=key-0123456789abc,x-tenant=acme"
        )
    }
    said = (
        "export failed: {'Authorization': 'Bearer otlp-0123456789', "
        "'x-api-key': 'key-0123456789abc', 'x-tenant': 'acme'} (token otlp-0123456789)"
    )
    assert scrubbed(said, environ) == (
        "export failed: {'Authorization': '***', 'x-api-key': '***', 'x-tenant': 'acme'} "
        "(token ***)"
    )


def test_scrubbing_leaves_what_is_not_a_secret():
    environ = {"HF_TOKEN": "hf_abcdef123456", "RLFT_SECRET_ENV": "A, B", "A": "alpha-secret"}
    text = "GET https://hub/x?revision=main&token=hf_abcdef123456 alpha-secret s3://b/run"
    assert scrubbed(text, environ) == "GET https://hub/x?revision=main&token=*** *** s3://b/run"
    # A short value (a branch, a flag) is not blanked out of every message.
    assert scrubbed("on main", {"RLFT_SECRET_ENV": "B", "B": "main"}) == "on main"
    said = "redis://:pw123@h/0 https://tok@h/x?author=me&design=a&X-Amz-Signature=abc&api_key=z"
    assert scrubbed(said, {}) == (
        "redis://***@h/0 https://***@h/x?author=me&design=a&X-Amz-Signature=***&api_key=***"
    )


def test_scrubbing_a_long_line_of_question_marks_ends():
    """A line of `?` (a reward printing a model's stuck output) made each `?` rescan the
    rest of the line for a secret query name: quadratic, minutes for a few hundred KB."""
    code = "from rlft.trainer.redaction import scrubbed; print(scrubbed(input(), {})[-16:])"
    ended = subprocess.run(
        [sys.executable, "-c", code],
        input="?" * 200_000 + "?a?token=tok-0123456789&x=1\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ended.stdout == "?a?token=***&x=1\n", ended.stderr


def run_scrubbed_python(code: str) -> subprocess.CompletedProcess:
    """`code` run with its output scrubbed and piped, as a pod's is."""
    prelude = "import os, sys\nfrom rlft.trainer.redaction import scrub_output\nscrub_output({})\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60
    )


def test_flushing_long_words_to_a_pipe_ends():
    """Looking for a partial line's last word ran from each character of a long word
    that a space ended: 2000 flushes of a 4 KB word took minutes."""
    code = 'for _ in range(2000):\n    sys.stdout.write("x" * 4096 + " "); sys.stdout.flush()\n'
    ended = run_scrubbed_python(code + 'print("end")')
    assert ended.stdout.endswith("x end\n") and len(ended.stdout) == 2000 * 4097 + 4, ended.stderr


def test_a_forked_child_does_not_print_what_its_parent_holds_back():
    """A word the parent holds (it may become a URL's credentials) is the parent's to pass
    on: a forked child (a reward's multiprocessing pool) printed it inside its own output."""
    code = """
sys.stdout.write("parent: loading https://me"); sys.stdout.flush()
child = os.fork()
if child == 0:
    sys.stdout.write("child: done\\n"); sys.stdout.flush(); os._exit(0)
os.waitpid(child, 0)
sys.stdout.write(":pw@host/x\\n")
"""
    ended = run_scrubbed_python(code)
    assert ended.stdout == "parent: loading child: done\nhttps://***@host/x\n", ended.stderr


def test_a_child_forked_while_the_secrets_were_being_remembered_still_scrubs():
    """The parent's lock of what it has seen was held at the fork (another thread
    remembering rotated credentials): the child's first look waited for it forever."""
    code = """
from rlft.trainer import redaction, secret_sources
secret_sources._SEEN_LOCK.acquire()
child = os.fork()
if child == 0:
    import signal; signal.alarm(20)  # broken, it would wait forever: it ends instead
    secret_sources.remember(["child-secret-0123456789"])
    print(redaction.scrubbed("child: child-secret-0123456789"), flush=True); os._exit(0)
os.waitpid(child, 0)
"""
    ended = run_scrubbed_python(code)
    assert ended.stdout == "child: ***\n", (ended.stdout, ended.stderr)


def test_a_multiprocessing_child_passes_on_what_it_held_of_its_last_line():
    """A multiprocessing child ends by `os._exit`, which runs no atexit: the last word it
    held back (it might have become a URL's credentials) was lost. Its exit's finalizers
    pass it on now, scrubbed: for a Process and for a Pool's worker, and only once the
    threads still writing have ended."""
    code = """
import multiprocessing
fork = multiprocessing.get_context("fork")
def work(end):
    sys.stdout.write(f"child: fetched https://me{end} "); sys.stdout.flush()
    sys.stdout.write("and ends on a word"); sys.stdout.flush()
for end in ("", ":pw@host/x"):
    child = fork.Process(target=work, args=(end,)); child.start(); child.join()
pool = fork.Pool(1)
pool.apply(work, ("?token=tok-123456",)); pool.close(); pool.join()
import threading, time
def talk():  # still writing after the target returned: threads are joined after it
    sys.stdout.write(" thread: https://me:p"); sys.stdout.flush(); time.sleep(0.5)
    sys.stdout.write("w@host/x")
def leave_a_thread():
    threading.Thread(target=talk).start(); time.sleep(0.1)
child = fork.Process(target=leave_a_thread); child.start(); child.join()
print("|parent")
"""
    ended = run_scrubbed_python(code)
    assert ended.stdout == (
        "child: fetched https://me and ends on a word"
        "child: fetched https://***@host/x and ends on a word"
        "child: fetched https://me?token=*** and ends on a word"
        " thread: https://***@host/x|parent\n"
    ), (ended.stdout, ended.stderr)


@pytest.mark.parametrize(
    "command",
    [
        # What a pod runs (the console script's entry point)...
        [str(Path(sys.executable).parent / "rlft"), "rollout"],
        # ...and a local run's rollout servers, started as a module.
        [sys.executable, "-m", "rlft.trainer.rollout.server"],
    ],
    ids=["rlft", "module"],
)
def test_a_rollout_servers_output_is_scrubbed_too(command: list[str]):
    env = dict(os.environ, JUDGE_API_KEY=KEY)
    ended = subprocess.run(
        [*command, "--engine", KEY], env=env, capture_output=True, text=True, timeout=120
    )
    assert ended.returncode == 2, ended.stderr
    assert "invalid choice: '***'" in ended.stderr and KEY not in ended.stderr, ended.stderr


def test_the_operators_output_is_scrubbed_too():
    """Its image runs `python -m rlft.operator`, not the `rlft` command."""
    env = dict(os.environ, JUDGE_API_KEY=KEY)
    operator = [sys.executable, "-m", "rlft.operator"]
    for option, error in [("--metrics-bind", "'***': expected"), ("--priority", "value: '***'")]:
        ended = subprocess.run(
            [*operator, option, KEY], env=env, capture_output=True, text=True, timeout=120
        )
        assert ended.returncode == 2, ended.stderr
        assert error in ended.stderr and KEY not in ended.stderr, ended.stderr


def test_output_is_scrubbed_a_line_at_a_time():
    """A secret written in pieces is whole when looked for; a partial line (a progress
    bar's update) still goes on at a flush; the rest is the wrapped stream's."""
    under = io.StringIO()
    stream = ScrubbedStream(under, secret_values({"JUDGE_TOKEN": "tok-0123456789"}), words=False)
    stream.write("key tok-01")
    assert under.getvalue() == ""
    stream.write("23456789 and https://me:pw@host/x\nmore")
    assert under.getvalue() == "key *** and https://***@host/x\n"
    stream.flush()
    assert under.getvalue().endswith("\nmore")  # no end of it may begin the secret
    stream.writelines(["\rbar 1/2 tok-0123456789", "\r"])
    assert under.getvalue().endswith("more\rbar 1/2 ***\r")
    assert stream.getvalue() == under.getvalue()  # what it does not do is the stream's


def test_a_url_cut_by_a_flush_waits_for_its_end_unless_a_terminal_shows_it():
    """Written to a file or a pipe, the last word of a partial line may be a URL whose
    credentials come after the flush; on a terminal, a prompt's last word shows now."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    piped, terminal = io.StringIO(), Terminal()
    streams = [ScrubbedStream(under, []) for under in (piped, terminal)]
    for stream in streams:
        stream.write("fetching https://me")
        stream.flush()
    assert piped.getvalue() == "fetching "
    assert terminal.getvalue() == "fetching https://me"
    for stream in streams:
        stream.write(":pw@host/x and more\n")
    assert piped.getvalue() == "fetching https://***@host/x and more\n"


def test_a_secret_of_several_lines_is_scrubbed_line_by_line():
    """A PEM key or a service account's JSON reaches the stream cut at its line ends."""
    key = "-----BEGIN KEY-----\nMIIEvQIBADANBgkq\nhkiG9w0BAQEFAASC\n-----END KEY-----"
    under = io.StringIO()
    stream = ScrubbedStream(under, secret_values({"GCP_SA_KEY": key}))
    print("the key is", key, file=stream)
    print("MIIEvQIBADANBgkq alone", file=stream)
    stream.flush()
    assert "MIIE" not in under.getvalue() and "hkiG" not in under.getvalue(), under.getvalue()
    assert under.getvalue().endswith("*** alone\n"), under.getvalue()
