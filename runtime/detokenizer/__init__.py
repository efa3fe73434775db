"""What runs in the `ringserve::detokenizer` process: its entry point (main.py), its loop
(process.py) around the transport-free Detokenizer core (core.py: TOKEN_OUT records to
TEXT_OUT deltas, text_out.py: TEXT_OUT records and their blob), batched incremental decoding
(incremental.py) and stop strings (stop_strings.py); traced.py: the loop with first-token
stamps."""
