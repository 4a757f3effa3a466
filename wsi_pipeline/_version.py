"""The package's version, in a module of its own so that any module can name it without the package's face."""

__version__ = "0.1.0"
