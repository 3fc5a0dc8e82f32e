"""The one error type for a user's mistake (CLI flag, recipe, environment).

A ConfigError carries a single line that names the problem and the fix; the CLI
prints it and exits 2 before anything is started. Never raise it for a bug in
ftrun itself, and never let it carry a traceback to the user.
"""


class ConfigError(Exception):
    """Bad input from the user: one line, exit status 2, nothing started."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
