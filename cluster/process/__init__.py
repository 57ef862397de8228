"""Child processes forked from a template that imported the heavy libraries once (ProcessTemplate)."""
