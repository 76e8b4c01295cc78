"""The package's version, in a module of its own: read by the plan cache's key without importing the
package root (which imports the rest of the package)."""

__version__ = "0.1.0"
