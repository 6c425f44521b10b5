"""The accumulation machinery behind ``Accelerator``: the micro-step and its observers, the
gradients' backward, prepare and what it registers, ``on_oom``. Private: the public API
is ``gradsync.Accelerator``; ``gradsync._assembly`` wires these parts into one.
"""
