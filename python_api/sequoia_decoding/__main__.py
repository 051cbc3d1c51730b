"""``python -m sequoia_decoding``: the sequoia-kernels command line."""

import sys

from .cli import main

sys.exit(main())
