"""The release of this gradsync (written into the checkpoints it saves)."""

__version__ = "0.2.0"
