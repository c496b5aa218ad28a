"""``python -m mixer.cli``: the ``mixer`` command."""

import sys

from mixer.cli.commands import main

sys.exit(main())
