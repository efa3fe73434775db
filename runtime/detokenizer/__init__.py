"""What runs in the `ringserve::detokenizer` process: its loop (process.py), TOKEN_OUT
records to TEXT_OUT deltas (deltas.py), batched incremental decoding (incremental.py)
and stop strings (stop_strings.py)."""
