"""Building transformers models, one at a time in a process.

While it builds a model, transformers' `from_pretrained` replaces `tie_weights` and
`init_weights` of `PreTrainedModel` itself (the class, so every thread sees it) with
no-ops, and puts them back after. A model built on another thread meanwhile comes out
with its output embedding untied from its input one: a different model, whose optimizer
state has a tensor more, so its checkpoints and its peers' do not load into each other.
Two such loads at once (two rollout engines in one process) can put back each other's
no-ops and leave tying off for the rest of the process. So every model rlft builds is
built through `from_config` or `from_pretrained` here, under one lock.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

_ONE_AT_A_TIME = threading.RLock()  # re-entrant: a build may build a part of itself


def from_config(auto_class: Any, config: Any, **kwargs: Any) -> Any:
    """`auto_class.from_config(config, **kwargs)`, with no other build under way."""
    with _ONE_AT_A_TIME:
        return auto_class.from_config(config, **kwargs)


def from_pretrained(auto_class: Any, folder: str | Path, **kwargs: Any) -> Any:
    """`auto_class.from_pretrained(folder, **kwargs)`, with no other build under way."""
    with _ONE_AT_A_TIME:
        return auto_class.from_pretrained(folder, **kwargs)
