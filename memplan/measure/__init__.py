"""The measurement side: the only code that imports torch (reference model, instruments, trace, profile)."""
