"""The contract every backend and case is written against: the plugin API, conventions, validation, the float64
reference and the tolerance rule. It imports nothing else of mha_harness."""
