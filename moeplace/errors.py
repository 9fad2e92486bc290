"""User-facing errors: the CLI prints these as one line and exits with code 2."""

from __future__ import annotations


class MoeplaceError(Exception):
    """Bad input from the user (a file, a flag): reported as one line, never a traceback."""


class FormatError(MoeplaceError):
    """A file is malformed, truncated or of an unsupported kind."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class PlacementError(MoeplaceError):
    """A placement is invalid or does not fit the model or rank layout."""
