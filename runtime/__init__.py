"""ringserve runtime: server arguments, the engine processes and their loops."""
