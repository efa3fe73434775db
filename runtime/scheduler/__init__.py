"""What runs in the `ringserve::scheduler` process: its loop (process.py) around the
scheduling core (core.py), the request table and its C bookkeeping, the radix prefix
cache, the queue policy and the model runner it drives."""
