"""``python -m phalanx ...`` is the ``phalanx`` command."""

import sys

from phalanx.cli.main import main

sys.exit(main())
