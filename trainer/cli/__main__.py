import sys

from rlft.trainer.cli.main import main

sys.exit(main())
