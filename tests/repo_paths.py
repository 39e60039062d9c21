"""Where the tests' own files are: the test tree, its fixtures, the checkout and its tools.

Test modules sit one folder down (tests/model/, tests/kernels/, ...), so they name these
folders from here rather than counting parents of their own ``__file__``."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures"
REPO = TESTS.parent
TOOLS = REPO / "tools"
