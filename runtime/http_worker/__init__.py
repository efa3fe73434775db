"""What runs in each granian worker process: the ASGI app's routes and streams, the
TokenizerManager that owns the worker's rings, the prompt encoder and the worker's metrics."""
