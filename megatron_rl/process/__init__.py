"""This process's life: how it stops when signalled (`stop.py`), and that nothing it started
outlives it (`children.py`). Only the standard library is imported here: every layer may use it."""
