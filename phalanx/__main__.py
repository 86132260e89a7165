"""``python -m phalanx ...`` is the ``phalanx`` command."""

import sys

from phalanx.cli import main

sys.exit(main())
