"""`python -m specdec.train.data ...` and `accelerate launch -m specdec.train.data ...`."""

import logging
import sys

from specdec.train.data.cli import main

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
try:
    sys.exit(main())
except ValueError as err:
    print(f"specdec.train.data: error: {err}", file=sys.stderr)
    sys.exit(2)
