"""`nodus`: the command line, by subject over one module of shared pieces:

common.py    the bus flags, `-o` and how it renders, AGE, the command registry
jobs.py      apply, get jobs|job|nodes|node|ranktables, describe job, env, logs, delete, usage
repair.py    get alerts|recommendations|remediations, describe remediation|alert, approve,
             cancel, repair request, breaker, fault
policy.py    policy get|set
system.py    up, demo, schema
daemons.py   placer, agent, relay, runner, remediator, monitor
parser.py    all of them on one parser, and `main` (the `nodus` console script)"""

from app.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
