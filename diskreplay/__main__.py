"""`python -m diskreplay`: the command line."""

from .cli import main

raise SystemExit(main())
