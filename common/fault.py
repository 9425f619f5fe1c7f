"""Fault injection for the chaos benchmark (bench/chaos.py): a process SIGKILLs itself in the middle of a write
that is too fast to interrupt from outside at a chosen moment.

`SLIPSTREAM_FAULT=POINT:ARM_FILE` (read once, at import) names a fault point and an arming file. When the
process reaches `fault_point(POINT)` while ARM_FILE exists, it removes the file and kills itself with SIGKILL;
removing the file first makes the fault fire once per arming, so a restarted process runs on. The points:
`checkpoint_save` (trainer/checkpoint.py: every data file of a checkpoint written, its `.metadata` not) and
`publish` (common/weights/writer.py: the first shard of a weight version in place, the rest, the index and the
commit not). Unset (the default), a fault point costs one string comparison.
"""

from __future__ import annotations

import os
import signal

POINTS = ("checkpoint_save", "publish")


def _parse(text: str) -> tuple[str, str]:
    if not text:
        return "", ""
    point, _, arm = text.partition(":")
    if point not in POINTS or not arm:
        raise ValueError(
            f"SLIPSTREAM_FAULT={text!r}: write POINT:ARM_FILE with POINT one of {', '.join(POINTS)} "
            "(or unset it: it is for the chaos benchmark only)"
        )
    return point, arm


_POINT, _ARM = _parse(os.environ.get("SLIPSTREAM_FAULT", ""))


def fault_point(name: str) -> None:
    """SIGKILL this process here if SLIPSTREAM_FAULT names this point and its arming file exists (see above)."""
    if name != _POINT:
        return
    try:
        os.unlink(_ARM)  # only one process (and one call) wins the arming
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
