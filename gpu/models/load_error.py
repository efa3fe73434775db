"""The one error a model that cannot be loaded raises, below both the GGUF reader
(gguf_file.py) and the model's files (model_files.py, which re-exports it), so that each can
raise it without importing the other."""


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message is one line meant for the user."""
