"""`gradsync verify`: what the command does with its parsed arguments."""

from __future__ import annotations

import argparse

from gradsync.launch.commands import launch_config


def run(args: argparse.Namespace) -> int:
    """Launch the script as given and again in one process, and print the verdict (or,
    with ``--dry-run``, what would run)."""
    from gradsync.launch.torchrun import Launcher
    from gradsync.verify.runner import verify

    config = launch_config(args)
    if args.dry_run:
        launcher = Launcher(config)
        print(launcher.describe())
        print(
            f"then: the same script in one process (backend single, each window k x "
            f"{launcher.config.world_size} micro-batches replayed), {args.steps} optimizer steps each"
        )
        return 0
    report = verify(
        config,
        steps=args.steps,
        max_seconds=args.max_seconds,
        rtol=args.rtol,
        folder=args.verify_dir,
    )
    print(report.render(), flush=True)
    return report.exit_code
