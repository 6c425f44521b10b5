"""`python -m gradsync` is the `gradsync` command."""

from gradsync.cli import main

raise SystemExit(main())
