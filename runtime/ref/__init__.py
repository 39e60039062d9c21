"""numpy references for every kernel, written from the math (one module per family)."""
