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

from rlft.trainer import redaction
from rlft.trainer.redaction import (
    SECRET_PATH_ENV,
    LineScrubber,
    ScrubbedStream,
    scrubbed,
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
    (s3 / "..data" / "huge").write_bytes(b"x" * (redaction.LARGEST_SECRET_FILE + 1))
    (s3 / "huge").symlink_to("..data/huge")
    mounts = [str(judge), str(s3), str(single), str(tmp_path / "not-mounted")]
    environ = {SECRET_PATH_ENV: json.dumps(mounts)}
    text = (
        "judge-file-key-0123 dotted-0123456789 s3-secret-0123456789 single-file-token-0123 "
        f"eu-west {judge}/key"
    )
    # Each file once, whatever links lead to it; short values (a region) are not hidden,
    # and neither is where the files are.
    assert scrubbed(text, environ) == f"*** *** *** *** eu-west {judge}/key"
    assert len(secret_values(environ)) == 4
    # What is not a JSON list of paths is passed over: scrubbing never stops a process.
    for broken in ("/a:/b", '{"a": 1}', "[1, 2]"):
        assert scrubbed("x-0123456789", {SECRET_PATH_ENV: broken}) == "x-0123456789"


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
    # Without a source to ask, nothing is learnt.
    fixed = LineScrubber(["old-token-0123456789"])
    assert fixed.lines("new-token-0123456789\n") == "new-token-0123456789\n"


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


@pytest.mark.parametrize("mounted", [True, False], ids=["secret-mounted", "no-secret"])
def test_a_process_that_scrubs_its_own_output_reads_the_mounts(tmp_path, mounted):
    """`rlft` installs its stream filter with the files' values (a local run's output)."""
    folder = tmp_path / "judge"
    mount_secret(folder, {"key": "judge-file-key-0123"})
    env = dict(os.environ)
    env.pop(SECRET_PATH_ENV, None)
    if mounted:
        env[SECRET_PATH_ENV] = json.dumps([str(folder)])
    code = (
        "from rlft.trainer.redaction import scrub_output; scrub_output(); "
        f"print('key', open({str(folder / 'key')!r}).read())"
    )
    ended = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout == ("key ***\n" if mounted else "key judge-file-key-0123\n")
