"""A conversion's output directory, which appears only once it is complete.

Everything is written into a hidden sibling directory, renamed to the output at the end and
removed on any failure, so a failed conversion leaves no partial output behind.

Training checkpoints have their own staging (``checkpoint.store.prepare`` / ``commit``): a fixed
``step_N.tmp`` name that the next run recognises (to finish or remove it), split across the
ranks' barrier, and replacing an earlier save of the same step. A conversion's output is named by
a person, is written by one process, and must never replace anything: hence a unique hidden name
and a rename that refuses a non-empty output.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from contextlib import contextmanager
from typing import Iterator

from megatron_hydra.errors import CheckpointError


@contextmanager
def staged(output: str) -> Iterator[str]:
    """A new empty directory beside ``output`` to write into; renamed to ``output`` when the block
    ends, removed with its content when it raises. ``output`` must not exist or be an empty
    directory. A system error (a full disk) becomes one line naming ``output`` and the reason."""
    output = os.path.abspath(output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    stage = os.path.join(parent, f".{os.path.basename(output)}.{uuid.uuid4().hex[:12]}.partial")
    os.mkdir(stage)  # not mkdtemp: the output keeps the usual permissions, not 0700
    try:
        yield stage
        if os.path.isdir(output) and not os.path.islink(output):
            os.rmdir(output)  # empty, as the caller checked; rmdir refuses anything else
        os.replace(stage, output)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, OSError) and e.strerror:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            fix = "free space there or write elsewhere" if full else "fix that and run again"
            where = f": {e.filename}" if e.filename else ""
            raise CheckpointError(f"output={output}: writing failed ({e.strerror}{where}); nothing was written: "
                                  f"{fix}") from None
        raise
