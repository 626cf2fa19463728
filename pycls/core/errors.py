"""The one exception class for mistakes in what the user asked for.

A ``UserError`` is a bad config value, a path that does not exist, a checkpoint that does not fit
the model: things the user fixes, not bugs in pycls. Its message names the key or path and says
what to do. The command line (pycls.core.cli) prints it as one line and exits with
``EXIT_USER_ERROR``; any other exception is a bug and keeps its traceback.
"""

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the input (config, paths, files); ``one_line()`` is what the user sees."""

    prefix = "error"

    def one_line(self):
        return f"{self.prefix}: " + " ".join(str(self).split())


class ReportedError(UserError):
    """A UserError raised in a spawned process and passed to the parent as its one line."""

    def one_line(self):
        return str(self)
