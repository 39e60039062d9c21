"""``python -m llambda``: the ``llambda`` command."""
import sys

from .cli import main

sys.exit(main())
