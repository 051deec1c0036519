"""The network-namespace lab: one namespace per machine of a fleet, provider LANs, NAT
routers and private networks on one host (`nodus up --netns`, the Direct path's tests)."""

from app.netlab.lab import NetLab, clean_leftovers, in_namespace, missing_requirements
from app.netlab.topology import CONTROL_ADDRESS, Topology, plan

__all__ = [
    "CONTROL_ADDRESS",
    "NetLab",
    "Topology",
    "clean_leftovers",
    "in_namespace",
    "missing_requirements",
    "plan",
]
