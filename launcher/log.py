"""One log format for every process of the server: time, level, which process, logger, message."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "[%(asctime)s %(srt_process)s] %(levelname)s %(name)s: %(message)s"


class _ProcessLabel(logging.Filter):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def filter(self, record: logging.LogRecord) -> bool:
        record.srt_process = self.label
        return True


def configure_logging(level: str, label: str) -> None:
    """Replace the root handlers with one stderr handler; `label` names the process in every line
    ("main", "scheduler_TP1", "detokenizer")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_ProcessLabel(label))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
