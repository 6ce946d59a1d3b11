"""A plugin module that raises KeyboardInterrupt while it is imported."""
raise KeyboardInterrupt
