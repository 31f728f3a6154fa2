"""``python -m gateway.sim ARGS`` (same as ``kvgate sim ARGS``)."""

import sys

from gateway.sim.cli import run

sys.exit(run(sys.argv[1:]))
