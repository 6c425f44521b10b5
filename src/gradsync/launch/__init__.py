"""The launcher: `gradsync launch | plan | env`, and the LaunchConfig/Launcher behind it."""

from gradsync.launch.config import LaunchConfig
from gradsync.launch.torchrun import Launcher

__all__ = ["LaunchConfig", "Launcher"]
