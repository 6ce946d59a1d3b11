"""The benchmark engine: sweeps, memory measurement and fidelity figures."""
