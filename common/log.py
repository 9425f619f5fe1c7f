"""One log format for every role: `time level role experiment | message`.

`setup` is called once per process (by `slipstream run` and the launcher); every module then logs
through the standard `logging.getLogger(__name__)`. Secrets never go into messages.
"""

from __future__ import annotations

import logging
import sys
import time

_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)-7s %(role)s %(exp)s | %(message)s"


class _Context(logging.Filter):
    def __init__(self, role: str, exp: str) -> None:
        super().__init__()
        self.role, self.exp = role, exp

    def filter(self, record: logging.LogRecord) -> bool:
        record.role, record.exp = self.role, self.exp
        return True


def setup(role: str, exp: str, level: str = "info") -> None:
    """Route all logging of this process to stderr in the common format, tagged with role and experiment."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = logging.Formatter(_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    handler.addFilter(_Context(role, exp))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Third-party chatter at INFO drowns the run's own lines.
    for noisy in ("aiohttp.access", "urllib3", "asyncio", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
