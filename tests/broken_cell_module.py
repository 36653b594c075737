"""A --cell module that fails while it is imported (tests/test_cells.py)."""

raise RuntimeError("this module is broken on purpose")
