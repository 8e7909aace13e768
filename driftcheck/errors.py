"""The one exception type users see: a bad input, reported as one line and exit code 2."""


class DriftcheckError(Exception):
    """A user-facing failure: what went wrong, where, and how to fix it, in one line.

    The CLI prints ``str(err)`` on stderr and exits with code 2; no traceback unless ``--debug``.
    """


class TraceError(DriftcheckError):
    """A trace directory that is missing, incomplete, corrupt or of an unknown format."""
