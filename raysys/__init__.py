"""raysys: measured speed/quality search for training workloads on Ray."""
__version__ = "0.1.0"
