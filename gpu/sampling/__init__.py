"""Choosing each row's next token from the logits, per request's sampling parameters."""
