"""`python -m patchc ...` is the `patchc` command."""

import sys

from patchc.job.cli import main

sys.exit(main())
