"""``python -m llambda``: the ``llambda`` command."""
import sys

from llambda.cli import main

sys.exit(main())
