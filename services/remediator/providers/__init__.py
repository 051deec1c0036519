"""Machine providers that reach real machines (R18), chosen per pool in the remediator's config:
`inband` (the agent reboots its own host), `redfish` (the BMC), `exec` (the operator's
commands), and `local` (the lab's stand-in, `app.lab.provider.LocalProvider`, handed in).
`router.PoolProviders` picks one per pool and action; `revalidation` runs on the machine."""
