"""`python -m specdec.train` and `accelerate launch -m specdec.train`: the same code path as `specdec train`.

    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml -m specdec.train --config recipes/X.yaml
"""

import logging
import sys

from specdec.train.distill import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    try:
        sys.exit(main(sys.argv[1:]))
    except ValueError as err:  # boundary errors carry their fix; same behaviour as the specdec CLI
        print(f"specdec.train: error: {err}", file=sys.stderr)
        sys.exit(2)
