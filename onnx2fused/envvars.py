"""Environment variables set for the length of a block, then restored: the build targets a command's
options stand for (cli.build_targets, read by targets.py) and the run-time switches validation runs its
input sets under again (validate's run_variants, read by the plugin on every run)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Mapping


@contextmanager
def environment(values: Mapping[str, str]):
    """os.environ with `values` set inside the block; afterwards each variable as it was (unset if it was)."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        os.environ.update(values)
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
