"""Engine-facing I/O: the HTTP transport and the dialects' wire formats."""
