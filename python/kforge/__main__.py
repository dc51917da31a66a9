"""`python -m kforge ...` is the `kforge` command."""

import sys

from .cli import main

sys.exit(main())
