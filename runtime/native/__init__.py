"""ctypes bindings for every kernel: validate first, then call (one module per family)."""
