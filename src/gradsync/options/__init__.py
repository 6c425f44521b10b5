"""Each backend's settings, declared once (no torch): ``settings`` gathers them, the
adapters in ``gradsync.backends`` read them."""
