"""``python -m arpo_cli ARGS`` is ``arpo ARGS``."""

import sys

from arpo_cli.cli import main

sys.exit(main())
