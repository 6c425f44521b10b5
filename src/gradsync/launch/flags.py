"""The flags of `gradsync launch` (torchrun's, the settings', Accelerate's launch flags)
and the argument types the parser shares."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from gradsync.accelerate._compat import FLAGS
from gradsync.errors import ConfigError
from gradsync.settings import LAUNCH_SETTINGS, Setting


def flag_type(s: Setting) -> Callable[[str], Any]:
    """An argparse type for a setting's flag: its text read as its GRADSYNC_* variable's is."""
    kind = "int" if int in s.members else "float" if float in s.members else "JSON"

    def convert(text: str) -> Any:
        try:
            return s.from_text(text, str(s.flag))
        except ConfigError:
            hint = f" (give {s.hint})" if s.hint else ""
            raise argparse.ArgumentTypeError(f"invalid {kind} value: {text!r}{hint}") from None

    convert.__name__ = kind
    return convert


def add_setting_flags(p: argparse.ArgumentParser, settings: Sequence[Setting]) -> None:
    """The flags of ``settings`` (gradsync.settings declares them), in both spellings."""
    for s in settings:
        if s.flag is None:
            raise TypeError(f"setting {s.name} has no flag")
        help_ = s.doc.replace("%", "%%")
        if s.switch:
            add_flag(p, s.flag, dest=s.name, action="store_true", help=help_)
        elif bool in s.members:
            add_flag(
                p,
                s.flag,
                dest=s.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_,
            )
        else:
            add_flag(
                p,
                s.flag,
                dest=s.name,
                type=flag_type(s),
                default=None,
                metavar=s.metavar or s.name.upper(),
                help=help_,
            )


def positive_list(text: str) -> list[int]:
    """An argparse type: whole numbers >= 1, comma-separated."""
    return [positive(part.strip()) for part in text.split(",") if part.strip()]


def add_flag(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    dest: str | None = None,
    **kwargs: Any,
) -> None:
    """A flag in torchrun's two spellings, --max-restarts and --max_restarts (the second
    hidden from --help, so errors and usage name the first)."""
    dest = dest or flag[2:].replace("-", "_")
    p.add_argument(flag, dest=dest, **kwargs)
    snake = "--" + flag[2:].replace("-", "_")
    if snake != flag:
        kwargs.pop("metavar", None)
        p.add_argument(snake, **{**kwargs, "help": argparse.SUPPRESS}, dest=dest)


def nproc(text: str) -> int | str:
    """--nproc-per-node: a whole number >= 1, or auto / cpu / gpu (as torchrun)."""
    if text in ("auto", "cpu", "gpu"):
        return text
    return positive(text)


def nnodes(text: str) -> str:
    """--nnodes: N, or MIN:MAX for an elastic job; each a whole number >= 1."""
    parts = text.split(":")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"{text!r} must be N or MIN:MAX, e.g. 1:4")
    values = [positive(part) for part in parts]
    if len(values) == 2 and values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN must not exceed MAX, e.g. 1:4")
    return text


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer; give a whole number >= 1"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1; give a whole number >= 1")
    return value


def add_accelerate_flags(group: Any) -> None:
    """``accelerate launch``'s flags (``gradsync.accelerate._compat.FLAGS``), in both spellings, as
    ``accelerate_<name>`` (None: not given)."""
    add_flag(
        group,
        "--config-file",
        dest="config_file",
        default=None,
        metavar="YAML",
        help="the same as --config (Accelerate's spelling)",
    )
    group.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="accepted: a failing worker is reported in one block anyway",
    )
    for f in FLAGS:
        flag = "--" + f.name.replace("_", "-")
        help_ = f.help.replace("%", "%%")
        if f.switch:
            add_flag(group, flag, dest="accelerate_" + f.name, action="store_true", help=help_)
        else:
            kind: Callable[[str], Any] = {"int": int, "float": float}.get(f.kind, str)
            add_flag(
                group,
                flag,
                dest="accelerate_" + f.name,
                type=kind,
                default=None,
                metavar=f.metavar or "V",
                help=help_,
            )


def add_launch_flags(launch: argparse.ArgumentParser) -> None:
    """The flags of ``gradsync launch`` (torchrun's, the settings', Accelerate's), which
    ``gradsync verify`` takes too."""
    # torchrun's own flags, in both spellings (--nproc-per-node / --nproc_per_node). Not given
    # (None): from the scheduler's environment, else torchrun's default.
    add_flag(
        launch,
        "--nproc-per-node",
        type=nproc,
        default=None,
        metavar="N",
        help="processes per node: N, auto, cpu or gpu (default: SLURM_GPUS_ON_NODE "
        "or PET_NPROC_PER_NODE when set, else 1)",
    )
    launch.add_argument(
        "--nnodes",
        type=nnodes,
        default=None,
        metavar="N|MIN:MAX",
        help="nodes: N, or MIN:MAX for an elastic job (more than one needs "
        "--rdzv-endpoint, or --master-addr and --master-port, unless the "
        "scheduler gives them; default: the SLURM step's nodes, PET_NNODES, or 1)",
    )
    add_flag(
        launch,
        "--node-rank",
        type=int,
        default=None,
        metavar="R",
        help="this node's rank, 0 to nnodes-1 (with --master-addr; default: SLURM_NODEID, "
        "PET_NODE_RANK, or 0)",
    )
    add_flag(
        launch,
        "--master-addr",
        default=None,
        metavar="A",
        help="address of the node with node rank 0 (a static rendezvous)",
    )
    add_flag(
        launch,
        "--master-port",
        type=int,
        default=None,
        metavar="P",
        help="TCP port of the node with node rank 0 (1-65535)",
    )
    launch.add_argument(
        "--standalone",
        action="store_true",
        help="one node, a local rendezvous on a free port (the default on one node)",
    )
    add_flag(
        launch,
        "--rdzv-backend",
        default=None,
        metavar="B",
        help="rendezvous backend, e.g. c10d (the default with --rdzv-endpoint), static",
    )
    add_flag(
        launch,
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet (a multi-node or elastic job)",
    )
    add_flag(
        launch,
        "--rdzv-id",
        default=None,
        metavar="ID",
        help="the job's id at the rendezvous: the same on every node (default: the "
        "scheduler's job id; outside one, unique to this launch on one node)",
    )
    add_flag(
        launch,
        "--rdzv-conf",
        default=None,
        metavar="K=V,...",
        help="more rendezvous options, passed to torchrun",
    )
    add_flag(
        launch,
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restart every worker up to N times after a failure (default: PET_MAX_RESTARTS, or 0)",
    )
    add_flag(
        launch,
        "--monitor-interval",
        type=float,
        default=None,
        metavar="S",
        help="seconds between torchrun's checks of the workers (> 0; default: torchrun's)",
    )
    add_flag(
        launch,
        "--log-dir",
        default=None,
        metavar="DIR",
        help="a folder for torchrun's per-worker log files",
    )
    launch.add_argument(
        "--tee",
        default=None,
        metavar="STD",
        help="also write the workers' output to the log files: 0 none, "
        "1 stdout, 2 stderr, 3 both, or per local rank, e.g. 0:1,1:2",
    )
    launch.add_argument(
        "--redirects",
        default=None,
        metavar="STD",
        help="write the workers' output to the log files only (values as --tee)",
    )
    add_flag(
        launch, "--no-python", action="store_true", help="run SCRIPT as a program, not with python"
    )
    add_flag(
        launch,
        "--local-ranks-filter",
        default=None,
        metavar="RANKS",
        help="show the output of these local ranks only, e.g. 0,1",
    )
    add_flag(
        launch,
        "--start-method",
        default=None,
        metavar="exec|fork",
        help="exec: each worker a fresh interpreter (the default); fork: on CPU, copies of "
        "the launcher, which imported torch and gradsync once (seconds of CPU less "
        "per worker; docs/checkpoints.md)",
    )
    # The settings' flags (given: exported to the workers; not given: the config file's value).
    add_setting_flags(launch, LAUNCH_SETTINGS)
    launch.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="a config file: gradsync's settings, or Accelerate's (as `accelerate "
        "config` writes it), told apart by its keys",
    )
    add_flag(
        launch,
        "--dry-run",
        action="store_true",
        help="print the torchrun command and the settings, start nothing",
    )
    launch.add_argument(
        "-m", "--module", dest="module", action="store_true", help="run SCRIPT as a module"
    )
    add_accelerate_flags(
        launch.add_argument_group(
            "accelerate launch's flags",
            "in both spellings (--num_processes or --num-processes); "
            "each means what the key of its name in Accelerate's config file means "
            "(docs/launch-accelerate.md)",
        )
    )
