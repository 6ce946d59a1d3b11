"""The conformance engine: case registry, runner, isolated workers, results and reports."""
