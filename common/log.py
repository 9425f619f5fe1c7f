"""One log format for every role: `time level role experiment | message`.

`setup` is called once per process (by `slipstream run` and the launcher); every module then logs
through the standard `logging.getLogger(__name__)`. Secrets never go into messages.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)-7s %(role)s %(exp)s | %(message)s"


class _Context(logging.Filter):
    def __init__(self, role: str, exp: str) -> None:
        super().__init__()
        self.role, self.exp = role, exp

    def filter(self, record: logging.LogRecord) -> bool:
        record.role, record.exp = self.role, self.exp
        return True


def setup(role: str, exp: str, level: str = "info", handlers: Sequence[logging.Handler] = ()) -> None:
    """Route all logging of this process to `handlers` (default: stderr) in the common format, tagged with
    role and experiment."""
    formatter = logging.Formatter(_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    for handler in handlers or [logging.StreamHandler(sys.stderr)]:
        handler.setFormatter(formatter)
        handler.addFilter(_Context(role, exp))
        root.addHandler(handler)
    root.setLevel(level.upper())
    # Third-party chatter at INFO drowns the run's own lines.
    for noisy in ("aiohttp.access", "urllib3", "asyncio", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def reset() -> None:
    """Remove the handlers `setup` installed (a role's entry point run inside another program, a test)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if any(isinstance(f, _Context) for f in handler.filters):
            root.removeHandler(handler)
