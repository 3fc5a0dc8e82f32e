"""The one error type for a user's mistake (CLI flag, recipe, environment).

A ConfigError carries a single line that names the problem and the fix; the CLI
prints it and exits 2 before anything is started. It may carry the option key
it is about and where that value came from, so a recipe error is placed on its
line without parsing the message. Never raise it for a bug in ftrun itself,
and never let it carry a traceback to the user.
"""

from typing import Optional

from ftrun.exits import EXIT_USAGE


class ConfigError(Exception):
    """Bad input from the user: one line, exit status 2, nothing started."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, key: Optional[str] = None, problem: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.key = key                          # the option it is about, e.g. "nproc" or "hook.rank"
        self.problem = problem or message       # the message without its "where:" prefix

    def __str__(self) -> str:
        return self.message


# The command line as a source of values (ConfigError's "where:" and `--dry-run`'s table).
CLI = "command line"


def blame(key: str, message: str) -> ConfigError:
    """A cross-key problem, blamed on `key` (a recipe error lands on that key's line)."""
    return ConfigError(message, key=key, problem=message)


def from_source(source: str) -> str:
    """' (from PET_MASTER_ADDR)' for a value that did not come from the command line."""
    return "" if source in (CLI, "default") else f" (from {source})"
