import sys

from rlft.trainer.cli.entry import main

sys.exit(main())
