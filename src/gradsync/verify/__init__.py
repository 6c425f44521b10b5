"""``gradsync verify``: the runner (``runner``: the script launched and as one process, then
compared) and the in-process recorder it attaches as an extension (``recorder``)."""
