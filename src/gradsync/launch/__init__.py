"""The launcher: `gradsync launch | plan | env`, and the LaunchConfig/Launcher behind it."""

from gradsync.launch.torchrun import LaunchConfig, Launcher

__all__ = ["LaunchConfig", "Launcher"]
