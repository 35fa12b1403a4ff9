import sys

from specdec.cli import main

if __name__ == "__main__":  # guarded: the demo's evaluation stage starts a spawned process, which imports this module
    sys.exit(main())
