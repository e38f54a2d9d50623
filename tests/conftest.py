"""Settings shared by every test folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import settings

# CI replays the same examples every run (a red CI must be reproducible); locally,
# hypothesis explores new ones each time.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# The SeaweedFS S3 fixtures serve tests in several folders (checkpoint storage, resume).
sys.path.insert(0, str(Path(__file__).parent / "integration"))
from checkpoint_fixtures import bucket, s3_env, seaweed  # noqa: E402, F401
