"""A plugin module whose import never finishes."""
import time

time.sleep(3600)
