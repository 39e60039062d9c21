"""Errors a user can cause and fix: the CLI prints their message as one line, no traceback."""


class UserError(Exception):
    """Bad input from the user: a missing file, an invalid option, a prompt too long."""


class OptionError(UserError):
    """A bad value of one named option; ``field`` names it (the server's 400 names that field)."""

    def __init__(self, message, field):
        super().__init__(message)
        self.field = field
