"""The one exception type for invalid settings."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid gradsync setting. The message names the setting, the value and the fix."""
