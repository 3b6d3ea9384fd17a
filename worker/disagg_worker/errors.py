"""The error every start-up check raises (the configuration chain's, `config.py`)."""


class ConfigError(ValueError):
    """A start-up setting that cannot work; the message says which flag to change."""
