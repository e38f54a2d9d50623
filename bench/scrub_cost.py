"""What hiding secrets costs per line of output, as the number of values looked for grows.

    .venv/bin/python bench/scrub_cost.py

Every line a pod prints passes `LineScrubber` (`rlft scrubbed`, a process's streams), which
looks for each secret value and, in a partial line, for an end that may begin one. A
Secret volume holding a certificate bundle makes each of its lines a value looked for
(`secret_sources.looked_for`). Prints microseconds per line for one key and for a bundle
of about 3000 lines: whole lines, and lines written in two with a flush between (a
prompt, `print(..., end="")`), where the partial line's end is checked against every
value. No goal: it says what a large mounted Secret costs.
"""

from __future__ import annotations

import random
import string
import time

from rlft.trainer.redaction import LineScrubber

LINES = 2000
SPLIT = 200


def certificate(rng: random.Random) -> str:
    """A PEM block of 20 random base64 lines, as a CA bundle's certificates are."""
    alphabet = string.ascii_letters + string.digits + "+/"
    body = "\n".join("".join(rng.choice(alphabet) for _ in range(64)) for _ in range(20))
    return f"-----BEGIN CERTIFICATE-----\n{body}\n-----END CERTIFICATE-----\n"


def per_line(secrets: list[str], lines: list[str]) -> tuple[float, float]:
    """Seconds per whole line, and per line written in two with a flush between."""
    scrubber = LineScrubber(secrets, words=True)
    started = time.perf_counter()
    for line in lines:
        scrubber.lines(line)
    whole = (time.perf_counter() - started) / len(lines)
    started = time.perf_counter()
    for line in lines[:SPLIT]:
        scrubber.lines(line[:20])
        scrubber.partial()
        scrubber.lines(line[20:])
    split = (time.perf_counter() - started) / SPLIT
    return whole, split


def main() -> None:
    rng = random.Random(0)
    bundle = "".join(certificate(rng) for _ in range(136))  # 3000 lines
    lines = [
        f"step {i}: loss 0.{rng.randint(0, 10**6):06d} reward 0.5 https://host/path?x={i}\n"
        for i in range(LINES)
    ]
    for name, secrets in (("one key", ["sk-abcdefghijklmnop"]), ("3000-line bundle", [bundle])):
        whole, split = per_line(secrets, lines)
        print(
            f"{name:>17}: {whole * 1e6:7.1f} µs per whole line, "
            f"{split * 1e6:7.1f} µs per line written in two with a flush between",
            flush=True,
        )


if __name__ == "__main__":
    main()
