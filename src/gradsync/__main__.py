"""`python -m gradsync` is the `gradsync` command."""

from gradsync.launch.cli import main

raise SystemExit(main())
