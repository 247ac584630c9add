"""`python -m attnres ...` (also under torchrun) is the same as the `attnres` command."""

import sys

from attnres.cli import main

sys.exit(main())
