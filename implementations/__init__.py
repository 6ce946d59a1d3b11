"""The built-in backends, one module each; registered through the mha_harness.backends entry-point group.
The mutants/ sub-package holds deliberately broken backends, never registered."""
