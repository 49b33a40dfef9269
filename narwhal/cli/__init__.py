"""Console entry points. Each module exposes `main(argv=None) -> int`."""
