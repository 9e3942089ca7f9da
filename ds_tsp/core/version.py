"""The package version, in the core so that every layer (checkpoint manifests among them) can read it."""
__version__ = "0.1.0"
