"""`python -m patchc ...` is the `patchc` command."""

import sys

from patchc.cli import main

sys.exit(main())
