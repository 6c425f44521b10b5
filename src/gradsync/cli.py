"""`gradsync launch | verify | plan | env | bench`: the entry point. The parser is
``gradsync.launch.parser``; what each command does, ``gradsync.launch.commands``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gradsync.errors import ConfigError
from gradsync.launch import commands
from gradsync.launch.commands import launch_config, script_words
from gradsync.launch.parser import build_parser

__all__ = ["build_parser", "launch_config", "main", "script_words"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The benchmark parses its own flags (argparse's REMAINDER refuses a leading --flag).
        from gradsync.launch import bench

        return bench.main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command in ("launch", "verify"):
        args.script_args = commands.script_words(argv, args.script, args.script_args)
    if unknown:
        print(
            f"gradsync: error: {commands.unknown_flag(parser, args.command, unknown[0])}",
            file=sys.stderr,
        )
        return 2
    try:
        if args.command == "launch":
            return commands.launch(args)
        if args.command == "verify":
            from gradsync.verify import command

            return command.run(args)
        if args.command == "plan":
            return commands.plan(args)
        if args.command == "env":
            return commands.env()
        return commands.bench(args)
    except ConfigError as err:
        print(f"gradsync: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # torch missing where the launcher must start the workers
        print(f"gradsync: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
