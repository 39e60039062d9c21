"""Errors a user can cause and fix: the CLI prints their message as one line, no traceback."""


class UserError(Exception):
    """Bad input from the user: a missing file, an invalid option, a prompt too long."""
