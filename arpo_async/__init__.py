"""arpo-async: the contract shared by every process (config, messages, codec, transport, tasks, model I/O)."""

__version__ = "0.1.0"
