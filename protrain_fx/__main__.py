"""``python -m protrain_fx``: the command line (see :mod:`protrain_fx.cli`)."""

from protrain_fx.inspect.cli import main

raise SystemExit(main())
