"""What runs in each granian worker process: the ASGI app's routes and streams, the worker
process that owns the worker's rings (process.py, started by main.py) and its transport-free
TokenizerManager (core.py), the prompt encoder and the worker's metrics."""
