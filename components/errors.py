"""Errors that mean "fix the command or its setup": caught before any work, one line, exit code 2.

Every CLI and step program turns a ConfigError into one line on stderr (what, where, how to fix)
and exit code 2; orchestrators never retry exit code 2. Everything else is a runtime failure.
"""

from __future__ import annotations

import sys

# import name of an optional dependency -> the extra that brings it
EXTRAS = {
    "boto3": "s3",
    "botocore": "s3",
    "s3transfer": "s3",
    "mooncake": "mooncake",
    "kfp": "orchestration",
    "kfp_server_api": "orchestration",
    "hera": "orchestration",
    "kubernetes": "orchestration",
    "skimage": "sweep",
    "matplotlib": "report",
}


class ConfigError(Exception):
    """A usage or configuration problem found before any work started (exit code 2)."""


class MissingExtraError(ConfigError):
    """An optional dependency is not installed."""


def missing_extra(exc: ImportError, what: str = "this") -> MissingExtraError | None:
    """A MissingExtraError naming `pip install 'ardit[X]'` if `exc` is a missing optional
    dependency we know, else None (a real import bug stays a bug)."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        if "libibverbs" in str(exc):  # the mooncake wheel is there, its system library is not
            return MissingExtraError(f"{what} needs the system library libibverbs: apt-get install libibverbs1")
        return None
    hint = " (and apt-get install libibverbs1)" if extra == "mooncake" else ""
    return MissingExtraError(f"{what} needs the optional package {name!r}: pip install 'ardit[{extra}]'{hint}")


def one_line(text: object) -> str:
    """A message squashed to one line (a multi-line message would break the one-line contract)."""
    return " ".join(str(text).split())


def config_error_exit(prog: str, exc: BaseException, what: str | None = None) -> int | None:
    """The one exit-code-2 handler of every CLI and step program: a ConfigError, or an ImportError of
    a known optional extra (named `what`, default `prog`), is printed as `PROG: error: ...` on one
    line of stderr and gives 2. None for anything else: the caller re-raises it."""
    if isinstance(exc, ConfigError):
        message: object = exc
    elif isinstance(exc, ImportError) and (extra := missing_extra(exc, what or prog)) is not None:
        message = extra
    else:
        return None
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return 2
