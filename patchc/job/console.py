"""How the command line talks: its help lines, its output flags, and a user error as one line."""

from __future__ import annotations

import argparse

# Errors that mean "the input is wrong", shown as one line; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, RuntimeError, NotImplementedError, FloatingPointError, KeyError)


class HelpFormatter(argparse.HelpFormatter):
    """Every help line ends with its default, unless it is a switch, has none, or the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        switch = any(action.default is x for x in (None, False, True)) or action.default == argparse.SUPPRESS
        if "default" in text or switch or not action.option_strings:  # `is`: 0 and 1.0 are defaults, not switches
            return text
        return f"{text} (default: %(default)s)"


def add_output_flags(parser: argparse.ArgumentParser, debug: object, verbose: object, after: bool = False) -> None:
    """`--debug` and `-v`; a command's parser (`after`) takes them with SUPPRESS defaults, so `patchc -v eval`
    still counts, and counts its own `-v` apart (`verbose_after`): `patchc -v eval RUN -v` is -vv."""
    parser.add_argument("--debug", action="store_true", default=debug,
                        help="show the traceback of an error instead of one line")
    parser.add_argument("-v", "--verbose", action="count", default=verbose,
                        dest="verbose_after" if after else "verbose",
                        help="show patchc's INFO log lines on stderr (-vv: DEBUG too); warnings always show")


def one_line(exc: BaseException, command: str = "") -> str:
    """The message's first line (OSError: with its file; out of memory: where, and what to shrink), else its type."""
    if type(exc).__name__ == "OutOfMemoryError" or "DefaultCPUAllocator: can't allocate" in str(exc):  # torch's
        return __import__("patchc.job.memory", fromlist=["out_of_memory"]).out_of_memory(command, exc)
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
