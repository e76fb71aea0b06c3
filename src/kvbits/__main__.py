"""``python -m kvbits``: the same command line as the ``kvbits`` entry point."""

from kvbits.cli import main

raise SystemExit(main())
