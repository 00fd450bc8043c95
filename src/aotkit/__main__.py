"""``python -m aotkit ...`` runs the ``aotkit`` command (see :mod:`aotkit.cli`)."""

from aotkit.cli import main

raise SystemExit(main())
