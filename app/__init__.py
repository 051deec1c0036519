"""The `nodus` application: the CLI, `nodus up` (the whole system on this machine) and
`nodus demo`. It stands above libs/ and services/: it imports both, and nothing imports it."""
