"""Secrets handed over as files (a Secret volume, `RLFT_SECRET_PATH` naming its mounts)
are scrubbed as variables are: what a process reads from there and prints, by `print`,
by a write to the file descriptor or through a child, reaches no log; a Secret the
kubelet rewrites (rotated credentials) is hidden once looked at again, and so is its old
value. Files laid out as a kubelet lays them out; the real `rlft scrubbed` command."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlft.trainer import redaction, secret_sources
from rlft.trainer.redaction import LineScrubber, ScrubbedStream, scrubbed
from rlft.trainer.secret_sources import (
    LARGEST_SECRET_FILE,
    MOST_SECRET_FILES,
    SECRET_PATH_ENV,
    files_under,
    secret_values,
)

RLFT = str(Path(sys.executable).parent / "rlft")


def mount_secret(
    folder: Path, keys: dict[str, str], stamp: str = "..2026_12_07_19_00_00.1"
) -> None:
    """`keys` as a kubelet's atomic writer lays out a Secret volume: the files in a
    hidden folder, `..data` linked to it, a link per key (swapped over on a rewrite)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / stamp).mkdir()
    for name, value in keys.items():
        (folder / stamp / name).write_text(value)
    (folder / "..data_tmp").symlink_to(stamp)
    os.replace(folder / "..data_tmp", folder / "..data")
    for name in keys:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")


def test_the_files_of_mounted_secrets_are_secrets(tmp_path):
    judge, s3, single = tmp_path / "judge", tmp_path / "s3", tmp_path / "one" / "token"
    mount_secret(judge, {"key": "judge-file-key-0123\n", ".hidden-key": "dotted-0123456789"})
    mount_secret(s3, {"AWS_SECRET_ACCESS_KEY": "s3-secret-0123456789", "region": "eu-west"})
    single.parent.mkdir()
    single.write_text("single-file-token-0123")  # a subPath mount of one key
    (s3 / "..data" / "huge").write_bytes(b"x" * (LARGEST_SECRET_FILE + 1))
    (s3 / "huge").symlink_to("..data/huge")
    mounts = [str(judge), str(s3), str(single), str(tmp_path / "not-mounted")]
    environ = {SECRET_PATH_ENV: json.dumps(mounts)}
    text = (
        "judge-file-key-0123 dotted-0123456789 s3-secret-0123456789 single-file-token-0123 "
        f"eu-west {judge}/key"
    )
    # Short values (a region) are not hidden, and neither is where the files are.
    assert scrubbed(text, environ) == f"*** *** *** *** eu-west {judge}/key"
    # Each key once, through its link, not again inside `..data` or its timestamped folder.
    assert files_under(str(judge)) == [judge / ".hidden-key", judge / "key"]
    assert files_under(str(single)) == [single]
    # What is not a JSON list of paths is passed over: scrubbing never stops a process.
    nested = "[" * 100_000 + "]" * 100_000  # past the JSON parser's depth
    for broken in ("/a:/b", '{"a": 1}', "[1, 2]", nested, json.dumps(["/a\0b"])):
        assert scrubbed("x-0123456789", {SECRET_PATH_ENV: broken}) == "x-0123456789"


def test_files_that_secret_variables_name_are_secrets(tmp_path, monkeypatch):
    """IRSA's web identity token, a `*_PASSWORD_FILE`, a token path, a Google key file's
    path, the service account token: the variable names a file, whose content is the
    secret. Other paths' files are not read."""
    files = {
        "AWS_WEB_IDENTITY_TOKEN_FILE": "irsa-token-0123456789",
        "POSTGRES_PASSWORD_FILE": "pg-password-0123456789",
        "HF_TOKEN_PATH": "hf_file_token_0123456789",
        "GOOGLE_APPLICATION_CREDENTIALS": '{"private_key": "gcp-private-0123456789"}',
        "MODEL_PATH": "just-a-model-0123456789",
        "RELATIVE_TOKEN_FILE": "relative-0123456789",
    }
    environ = {}
    for name, content in files.items():
        (tmp_path / name).write_text(content)
        environ[name] = str(tmp_path / name)
    environ["RELATIVE_TOKEN_FILE"] = "RELATIVE_TOKEN_FILE"
    account = tmp_path / "serviceaccount-token"
    account.write_text("eyJhbGciOiJSUzI1NiJ9.account-0123456789")
    monkeypatch.setattr(secret_sources, "SERVICE_ACCOUNT_TOKEN", str(account))
    monkeypatch.chdir(tmp_path)
    said = " ".join([*files.values(), "gcp-private-0123456789", account.read_text()])
    assert scrubbed(said, environ) == (
        "*** *** *** *** just-a-model-0123456789 relative-0123456789 *** ***"
    )


def test_strings_inside_a_json_secret_are_hidden_as_a_program_prints_them(tmp_path):
    """A service account's key file: its `private_key` is stored with `\\n` escapes and
    printed decoded, cut at its line ends."""
    key = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG\nw0BAQEFAASCBKcwggSj\n-----END"
    account = {"type": "service_account", "private_key": key, "private_key_id": "0a1b2c3d4e5f"}
    mount_secret(tmp_path / "gcp", {"key.json": json.dumps(account)})
    environ = {SECRET_PATH_ENV: json.dumps([str(tmp_path / "gcp")])}
    said = f"loaded {account['private_key_id']} with key\n{key}\n"
    assert scrubbed(said, environ) == "loaded *** with key\n***\n"
    under = io.StringIO()
    stream = ScrubbedStream(under, secret_values(environ), words=False)
    print("line:", key.splitlines()[1], file=stream)
    assert under.getvalue() == "line: ***\n"


def test_a_rewritten_secret_is_hidden_once_looked_at_again_and_the_old_value_too(
    tmp_path, monkeypatch
):
    folder = tmp_path / "credentials"
    mount_secret(folder, {"token": "old-token-0123456789"})
    environ = {SECRET_PATH_ENV: json.dumps([str(folder)])}
    under = io.StringIO()
    stream = ScrubbedStream(
        under, secret_values(environ), words=False, refresh=lambda: secret_values(environ)
    )
    mount_secret(folder, {"token": "new-token-0123456789"}, stamp="..2026_12_07_20_00_00.2")
    print("before a look: new-token-0123456789", file=stream)
    monkeypatch.setattr(redaction, "REFRESH_SECONDS", 0.0)
    print("after: new-token-0123456789 old-token-0123456789", file=stream)
    assert under.getvalue() == "before a look: new-token-0123456789\nafter: *** ***\n"
    # Without a source to ask, nothing is learnt; a source that fails keeps what is known.
    fixed = LineScrubber(["old-token-0123456789"])
    assert fixed.lines("new-token-0123456789\n") == "new-token-0123456789\n"

    def broken() -> list[str]:
        raise RecursionError("a source that fails")

    failing = LineScrubber(["old-token-0123456789"], refresh=broken)
    assert failing.lines("old-token-0123456789 still\n") == "*** still\n"


AWKWARD = """
import json, os, sys, time
from rlft.trainer.secret_sources import secret_values
start = time.monotonic()
values = secret_values({"RLFT_SECRET_PATH": sys.argv[1]})
print(json.dumps({"values": values, "seconds": time.monotonic() - start}))
"""


def test_a_mount_that_is_large_looped_or_holds_a_fifo_does_not_hide_the_next_one(tmp_path):
    """Each mount's own MOST_SECRET_FILES; a FIFO (its read would block) and a folder
    linked into itself (each walk of it doubled) are passed over. In a subprocess with a
    timeout: without the first rule it hangs."""
    bundle, judge = tmp_path / "bundle", tmp_path / "judge"
    mount_secret(bundle, {f"cert-{i:03d}.pem": f"certificate-{i:03d}" for i in range(300)})
    os.mkfifo(bundle / "..data" / "a-fifo")
    (bundle / "a-fifo").symlink_to("..data/a-fifo")
    mount_secret(judge, {"key": "judge-file-key-0123"})
    for name in ("loop-a", "loop-b"):
        (judge / name).symlink_to(".")
    assert files_under(str(judge)) == [judge / "key"]  # once, however many ways lead to it
    mounts = json.dumps([str(bundle), str(judge)])
    ended = subprocess.run(
        [sys.executable, "-c", AWKWARD, mounts], capture_output=True, text=True, timeout=60
    )
    assert ended.returncode == 0, ended.stderr
    values = json.loads(ended.stdout)["values"]
    assert "judge-file-key-0123" in values
    # The bundle's first MOST_SECRET_FILES files, its FIFO (`a-fifo`, first) among them.
    certificates = [v for v in values if v.startswith("certificate-")]
    assert len(certificates) == MOST_SECRET_FILES - 1, len(certificates)


ROTATES = """
cat key; echo
ln -s ..2026_12_07_20_00_00.2 ..data_tmp && mv -T ..data_tmp ..data
cat key; echo
echo "old: $(cat ..2026_12_07_19_00_00.1/token)"
"""


def test_rlft_scrubbed_hides_what_a_command_reads_from_a_mounted_secret(tmp_path):
    """A reward's judge client (a shell here) prints the key it reads from the mount,
    then the kubelet rotates it: neither value reaches the log."""
    folder = tmp_path / "judge"
    mount_secret(folder, {"token": "old-token-0123456789"})
    (folder / "..2026_12_07_20_00_00.2").mkdir()
    (folder / "..2026_12_07_20_00_00.2" / "token").write_text("new-token-0123456789")
    (folder / "key").symlink_to("..data/token")
    # REFRESH_SECONDS at 0: the pump looks again at each chunk (10 s in a pod).
    code = (
        "import sys; from rlft.trainer import redaction; redaction.REFRESH_SECONDS = 0.0; "
        "from rlft.trainer.cli.scrubbed import main; sys.exit(main(sys.argv[1:]))"
    )
    env = dict(os.environ, **{SECRET_PATH_ENV: json.dumps([str(folder)])})
    ended = subprocess.run(
        [sys.executable, "-c", code, "--", "sh", "-c", ROTATES],
        cwd=folder,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout == b"***\n***\nold: ***\n", ended.stdout
    # The console script reads the mounts too.
    shown = subprocess.run(
        [RLFT, "scrubbed", "--", "sh", "-c", "cat key >&2"],
        cwd=folder,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert shown.returncode == 0 and shown.stderr == b"***", shown


OWN_OUTPUT = """
import os, sys
from rlft.trainer import redaction, secret_sources
redaction.scrub_output()
folder = sys.argv[1]
print("key", open(folder + "/key").read())
redaction.REFRESH_SECONDS = 0.0
os.symlink("..2026_12_07_20_00_00.2", folder + "/..data_tmp")
os.replace(folder + "/..data_tmp", folder + "/..data")  # the kubelet's rotation
print("new", open(folder + "/key").read(), flush=True)
# Its verdict (the job's status) is scrubbed by `scrubbed`, past values included.
os.write(1, redaction.scrubbed("verdict: old-token-0123456789").encode() + b"\\n")
"""


@pytest.mark.parametrize("mounted", [True, False], ids=["secret-mounted", "no-secret"])
def test_a_process_that_scrubs_its_own_output_reads_the_mounts(tmp_path, mounted):
    """`rlft` installs its stream filter with the files' values (a local run's output),
    and looks at them again; its verdict's scrubbing remembers a rotated value."""
    folder = tmp_path / "judge"
    mount_secret(folder, {"key": "old-token-0123456789"})
    (folder / "..2026_12_07_20_00_00.2").mkdir()
    (folder / "..2026_12_07_20_00_00.2" / "key").write_text("new-token-0123456789")
    env = dict(os.environ)
    env.pop(SECRET_PATH_ENV, None)
    if mounted:
        env[SECRET_PATH_ENV] = json.dumps([str(folder)])
    ended = subprocess.run(
        [sys.executable, "-c", OWN_OUTPUT, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ended.returncode == 0, ended.stderr
    if mounted:
        assert ended.stdout == "key ***\nnew ***\nverdict: ***\n"
    else:
        assert ended.stdout == (
            "key old-token-0123456789\nnew new-token-0123456789\nverdict: old-token-0123456789\n"
        )


REMEMBERING = """
import io, pathlib, sys
from rlft.trainer.redaction import ScrubbedStream, scrubbed
from rlft.trainer.secret_sources import secret_values
from rlft.trainer.storage.backends import S3Options
from rlft.trainer.storage.s3 import S3Storage

folder = pathlib.Path(sys.argv[1])
out = io.StringIO()
stream = ScrubbedStream(out, secret_values(), refresh=secret_values)
stream.write("before any client: nothing to hide\\n")
storage = S3Storage("s3://bucket/run", S3Options(credentials_dir=str(folder)))
old = (folder / "aws_secret_access_key").read_text().strip()
stream.write(f"old {old}\\n")
(folder / "aws_secret_access_key").write_text("rotated-secret-0123456789\\n")
assert storage._rotated()
stream.write("new rotated-secret-0123456789\\n")
stream.flush()
print(out.getvalue() + scrubbed(f"verdict {old} and rotated-secret-0123456789"))
"""


def test_credentials_rlft_reads_from_a_folder_no_variable_names_are_secrets(tmp_path):
    """A local run's `spec.checkpoint.credentialsDir` (or one on a volume the operator
    did not mount as a Secret, so `RLFT_SECRET_PATH` does not name it): the process's
    own output hides the key as soon as the S3 client has read it, not at the next look
    10 s later, and its verdict hides the rotated-away key too."""
    folder = tmp_path / "creds"
    folder.mkdir()
    (folder / "aws_access_key_id").write_text("AKIAEXAMPLE")
    (folder / "aws_secret_access_key").write_text("first-secret-abcdef012345\n")
    environ = {k: v for k, v in os.environ.items() if k != SECRET_PATH_ENV}
    done = subprocess.run(
        [sys.executable, "-c", REMEMBERING, str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        env=environ,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "before any client: nothing to hide",
        "old ***",
        "new ***",
        "verdict *** and ***",
    ], done.stdout
