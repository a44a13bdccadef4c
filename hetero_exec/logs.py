"""onnxruntime's log severities on Python logging.

Severity 0 VERBOSE, 1 INFO, 2 WARNING, 3 ERROR, 4 FATAL. Our records go through the
``hetero_exec`` and ``actors`` loggers, so a level is theirs, process-wide (Python
logging has no per-session loggers for module-level records); -1 leaves them alone.

>>> import logging
>>> python_level(3) == logging.ERROR
True
"""

from __future__ import annotations

import logging

from hetero_exec.errors import OptionError

LOGGERS = ("hetero_exec", "actors")
_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}


def python_level(severity: int, verbosity: int = 0) -> int:
    """Severity 0 with a verbosity V maps below DEBUG (DEBUG - V, at least 1)."""
    if severity not in _LEVELS:
        raise OptionError(f"log severity must be 0 (verbose) to 4 (fatal), got {severity!r}")
    level = _LEVELS[severity]
    return max(1, level - verbosity) if severity == 0 else level


def apply_severity(severity: int, verbosity: int = 0) -> None:
    """Set our loggers' level; -1 (onnxruntime's 'default') changes nothing."""
    if severity == -1:
        return
    level = python_level(severity, verbosity)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(level)


def set_default_logger_severity(severity: int) -> None:
    """onnxruntime.set_default_logger_severity: our loggers' level."""
    apply_severity(severity)


def set_default_logger_verbosity(verbosity: int) -> None:
    """Below DEBUG when the severity is verbose (0); otherwise nothing to change."""
    if verbosity < 0:
        raise OptionError(f"log verbosity must be >= 0, got {verbosity!r}")
    root = logging.getLogger(LOGGERS[0])
    if root.level and root.level <= logging.DEBUG:
        apply_severity(0, verbosity)
