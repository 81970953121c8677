"""The models' one error, below every other module of `cnns.models` (the registry and its entries raise it)."""

from cnns.errors import CnnsError


class ModelError(CnnsError):
    """An unknown architecture, size, option combination or split name."""
