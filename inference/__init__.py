"""After training: evaluate a checkpoint offline (`python -m inference.evaluate`) and serve it to a
robot over openpi-client's websocket policy protocol (`python -m inference.serve`)."""
