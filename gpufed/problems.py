"""How the CLI says something went wrong: one line on stderr, or with `-o json` a problem
document (RFC 9457) on stderr, so that stdout only ever holds an answer.

The broker's problems (`client.BrokerError`) are passed on as the broker wrote them (`type`,
`title`, `status`, `detail`, `field`, `errors`); what the CLI finds itself (a file that is not
there, no token, a broker it cannot reach) gets a `urn:gpufed:problem:cli-*` type and no
`status`. `run` is what `cli.main` calls every user command through: no traceback for any of
these, nor for a reader that went away (`gpufed list -o json | head`), nor for Ctrl-C.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from gpufed import client

PREFIX = "urn:gpufed:problem:"
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE, what a shell reports for `yes | head`
INTERRUPTED_EXIT = 130  # 128 + SIGINT


class CliError(Exception):
    """Something the CLI itself cannot do, said in one line: exit `code` (1; 2 for usage)."""

    def __init__(self, detail: str, *, kind: str, title: str, code: int = 1) -> None:
        super().__init__(detail)
        self.detail = detail
        self.kind = kind
        self.title = title
        self.code = code

    def problem(self) -> dict[str, Any]:
        return {"type": f"{PREFIX}cli-{self.kind}", "title": self.title, "detail": self.detail}


def file_error(exc: OSError, *, what: str = "file") -> CliError:
    """A file that cannot be read, in one line (`no such file: jobs.yaml`)."""
    if exc.filename is None:  # not a file's: say it as the system did
        return CliError(str(exc) or type(exc).__name__, kind="system", title="System error")
    reason = exc.strerror or type(exc).__name__
    detail = f"cannot read the {what} {exc.filename}: {reason}"
    return CliError(detail, kind="file", title="Cannot read")


def problem_of(exc: client.BrokerError | CliError) -> dict[str, Any]:
    """The problem document of an error."""
    if isinstance(exc, CliError):
        return exc.problem()
    if exc.body.get("type") or exc.body.get("title"):
        return dict(exc.body)
    if exc.status == 0:  # never answered
        return {"type": f"{PREFIX}cli-unreachable", "title": "Unreachable", "detail": exc.detail}
    return {"type": "about:blank", "title": "Error", "status": exc.status, "detail": exc.detail}


def report(command: str, exc: client.BrokerError | CliError, *, output: str) -> int:
    """Say what went wrong (stderr) and return the exit code."""
    if output == "json":
        print(json.dumps(problem_of(exc), indent=2), file=sys.stderr)
    else:
        print(f"gpufed {command}: {exc.detail}", file=sys.stderr)
        if isinstance(exc, client.BrokerError):
            for error in exc.body.get("errors", [])[1:]:
                print(f"  {error.get('field')}: {error.get('message')}", file=sys.stderr)
    return exc.code if isinstance(exc, CliError) else 1


def run(command: str, work: Callable[[], int], *, output: str = "table") -> int:
    """`work()`'s exit code; an error it raises said as `report` says it."""
    try:
        code = work()
        sys.stdout.flush()  # a reader gone shows here, not as the interpreter exits
        return code
    except (client.BrokerError, CliError) as exc:
        return report(command, exc, output=output)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            return _reader_gone()
        return report(command, file_error(exc), output=output)
    except KeyboardInterrupt:
        return INTERRUPTED_EXIT


def _reader_gone() -> int:
    """stdout's reader closed it (`| head`): stop quietly, as `yes | head` does. What is still
    buffered goes to /dev/null, so the interpreter's exit does not complain either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return BROKEN_PIPE_EXIT
