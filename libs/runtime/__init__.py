"""One way every daemon starts: uvloop, settings from flags and environment, structured logs,
a Prometheus /metrics endpoint, and a graceful stop on SIGTERM and SIGINT."""

from libs.runtime.service import add_common_flags, configure_logging, run_daemon

__all__ = ["add_common_flags", "configure_logging", "run_daemon"]
