"""The chaos run's daemons are watched like the end-to-end tests' (tests/e2e/conftest.py): no
error and no traceback in any log."""

from tests.e2e.conftest import (  # noqa: F401  (fixtures)
    _daemon_logs_of_the_module,
    _daemon_logs_of_the_test,
    daemon_logs,
)
