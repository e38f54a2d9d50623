"""The end of a partial line that may begin a secret waits for the rest of the line.
`Beginnings` finds that end with an index instead of a loop over every secret (a Secret
holding a certificate bundle makes each of its thousands of lines one): it must find
exactly what the plain definition does."""

from __future__ import annotations

import random

from rlft.trainer.redaction import Beginnings, LineScrubber


def _longest_end(text: str, secrets: list[str]) -> int:
    """The definition: the longest end of `text` that begins a secret longer than it."""
    return max(
        (
            length
            for secret in secrets
            for length in range(1, min(len(secret) - 1, len(text)) + 1)
            if text.endswith(secret[:length])
        ),
        default=0,
    )


def test_the_index_finds_the_longest_end_that_begins_a_secret():
    rng = random.Random(0)
    found = 0
    for _ in range(4000):
        # A small alphabet, so that ends and secrets overlap in every way: a secret
        # inside another, equal to the text's end, one character long, past HEAD.
        alphabet = "ab" if rng.random() < 0.5 else "abc-"
        secrets = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
            for _ in range(rng.randint(0, 6))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        expected = _longest_end(text, secrets)
        assert Beginnings(secrets).longest_end(text) == expected, (text, secrets)
        found += expected > 0
    assert found > 1000  # the cases where something waits are well covered


def test_a_whole_secret_at_the_end_begins_only_the_longer_secrets():
    """A secret equal to the text's end is no beginning of itself (it was hidden whole),
    only of a longer secret; past HEAD characters, the search decides."""
    assert Beginnings(["abcdefghij"]).longest_end("xxabcdefghij") == 0
    assert Beginnings(["abcdefghij", "abcdefghijk"]).longest_end("abcdefghij") == 10
    assert Beginnings(["abcdefghij"]).longest_end("xxabcdefghi") == 9
    assert Beginnings(["abcdefghij"]).longest_end("xxabcdefgh-") == 0
    assert Beginnings([]).longest_end("abc") == Beginnings(["", "a"]).longest_end("a") == 0


def test_a_partial_line_ending_in_the_start_of_one_line_of_a_bundle_waits_for_the_rest():
    rng = random.Random(1)
    lines = [
        "".join(rng.choice("ABCDEFabcdef0123456789+/") for _ in range(64)) for _ in range(3000)
    ]
    bundle = "-----BEGIN CERTIFICATE-----\n" + "\n".join(lines) + "\n-----END CERTIFICATE-----"
    scrubber = LineScrubber([bundle])
    scrubber.lines(f"copying {lines[1234][:40]}")
    assert scrubber.partial() == "copying "  # its first 40 characters wait
    assert scrubber.lines(f"{lines[1234][40:]} done\n") == "*** done\n"
    scrubber.lines(f"copying {lines[7][:60]}x")
    assert scrubber.partial() == f"copying {lines[7][:60]}x"  # the x ends any match
