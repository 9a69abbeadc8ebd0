"""``python -m benchmarks.converge``: the same as ``python -m benchmarks converge``."""
import sys

from .cli import main

sys.exit(main())
