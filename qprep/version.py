"""The package version, apart from qprep/__init__.py so that modules low in the package can name it without
importing the package's public API (which imports the whole pipeline)."""

__version__ = "0.1.0"
