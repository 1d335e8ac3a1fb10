"""The runtime's configuration error, below every module that raises it (runtime/config.py re-exports it), so a
reader that config.py calls (runtime/quant_config.py, for a checkpoint's FP8 experts) needs no import of config.py."""


class ConfigError(ValueError):
    """A model's configuration cannot be served; the message says which field and what to do."""
