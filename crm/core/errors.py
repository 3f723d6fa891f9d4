"""ConfigError: a setting that cannot work. The entry points report it as one line and exit 2;
anything else is a crash and keeps its traceback."""


class ConfigError(ValueError):
    pass
