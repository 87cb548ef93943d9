"""``python -m rope_ext.cli``: the ``rope-ext`` command."""

import sys

from rope_ext.cli import main

sys.exit(main())
