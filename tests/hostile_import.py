"""A plugin module that fails to import (as a broken third-party package would)."""
raise ImportError("hostile plugin: a dependency this plugin needs is missing")
