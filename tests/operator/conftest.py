"""Shared helpers of the operator tests. Must not import torch (the operator has none)."""

from __future__ import annotations

import sys
from pathlib import Path

# The helpers beside this file (crd_validation, kube_emulator, cluster) are imported by
# name; pytest's default import mode puts this folder on sys.path for the test modules,
# and this makes it explicit for the helpers' own imports.
sys.path.insert(0, str(Path(__file__).resolve().parent))
