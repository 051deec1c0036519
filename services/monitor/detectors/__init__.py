"""Sans-I/O detectors: each takes the bytes or values of one real format and returns findings.
Malformed input is skipped and counted, never raised (S3); the runner (`monitor.py`) does I/O."""
