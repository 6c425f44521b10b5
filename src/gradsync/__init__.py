"""gradsync: gradient accumulation that is correct and cheap on every PyTorch backend."""

from gradsync import audit
from gradsync.accelerator import Accelerator
from gradsync.batching import BatchPlan
from gradsync.config import Config
from gradsync.errors import ConfigError

__all__ = ["Accelerator", "BatchPlan", "Config", "ConfigError", "audit"]
__version__ = "0.1.0"
