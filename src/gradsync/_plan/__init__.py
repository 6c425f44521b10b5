"""The window and its sizes: the accumulation window (its micro-steps and boundary), the
batch plan (micro-batch x k x data-parallel size), the accumulation schedule, the planned
optimizer steps and what a plan costs (``gradsync plan --estimate``).
"""
