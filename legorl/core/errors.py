"""User-facing errors: each one is a single line that names what is wrong and where."""


class LegorlError(Exception):
    """An error caused by bad input or a broken environment, shown to the user as one line."""


class ShardError(LegorlError):
    """A shard file is unreadable, foreign, or holds a row that breaks its schema."""

    def __init__(self, path: object, message: str, row: int | None = None, field: str | None = None):
        where = str(path)
        if row is not None:
            where += f": row {row}"
        if field is not None:
            where += f": field '{field}'"
        super().__init__(f"{where}: {message}")
        self.path = path
        self.row = row
        self.field = field


class ConfigError(LegorlError):
    """A configuration value or command-line option is invalid."""
