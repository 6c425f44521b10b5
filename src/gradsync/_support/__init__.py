"""What every layer leans on: torch.distributed in a few calls, the launch environment,
the torch-internals and torch-range checks, the settings' declaration machinery.
"""
