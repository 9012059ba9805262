"""The `shardlang` command: parse the arguments, run the subcommand, and turn how it ended into an exit status."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from .arguments import build_parser
from .commands.apply import run_apply
from .commands.compile import run_compile
from .commands.convert import run_convert
from .commands.explain import run_explain
from .commands.init import run_init
from .commands.lint import run_lint
from .commands.search import run_search
from .signals import Terminated
from .status import UNUSABLE, UsageError

#: Each subcommand's function: the parsed arguments in, the exit status out.
COMMANDS: dict[str, Callable[..., int]] = {
    "lint": run_lint,
    "apply": run_apply,
    "explain": run_explain,
    "compile": run_compile,
    "init": run_init,
    "search": run_search,
    "convert": run_convert,
}


@functools.cache
def _parser():
    """The command line's parser, built once a process: building it is most of what a quick command costs
    (argparse formats every flag as it is added), and `main` may run many times in one process (a
    library's or a test's calls); parsing leaves it as it was."""
    return build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse's usage errors (2), --help and --version (0): a status, not an exit
        return e.code if isinstance(e.code, int) else UNUSABLE
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"shardlang: error: {e}", file=sys.stderr)
        return UNUSABLE
    except KeyboardInterrupt:
        print("shardlang: interrupted (Ctrl-C); no worker is left running", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"shardlang: stopped by {e.name}; no worker is left running", file=sys.stderr)
        return 128 + e.signum


def command() -> NoReturn:
    """The `shardlang` console script and `python -m shardlang`: `main`, then the processes multiprocessing
    started for the workers (the forkserver, the resource tracker) stopped and reaped before the shell gets
    its prompt back. `main` itself leaves them running for the next call in the same process (a library's,
    a test's). A command that started no worker imports nothing more."""
    status = main()
    if "shardlang.launch.servers" in sys.modules:
        from ..launch.servers import stop_servers

        stop_servers()
    sys.exit(status)


if __name__ == "__main__":
    command()
