"""The chaos run's fleet and jobs: the three paths' machines, and a job of each in turn."""

from __future__ import annotations

from libs.client.client import parse_job
from libs.contracts.jobs import Job, Phase


def fleet(netns: bool) -> str:
    """Four VMs on one VPC (Private gangs), three container-only machines (Relayed) and, in
    the network-namespace lab, three VMs of two providers without a private network, one
    behind NAT (Direct, over nodus0). Without the lab every machine shares this host's
    loopback, and there is no Direct gang (agents cannot each have a nodus0)."""
    if netns:
        vm, vpc, container = "198.18.1.{}", "198.18.101.{}", "198.19.5.{}"
    else:
        vm, vpc, container = "127.0.8.{}", "127.0.9.{}", "127.0.8.1{}"
    interface = "ens5" if netns else "lo"
    rows = [
        f"  - {{name: h-{i}, provider: aws, region: us-east-1, regionClass: us, offering: vm,\n"
        f"     address: {vm.format(i + 1)}, privateNetwork: use1-vpc, "
        f"privateAddress: {vpc.format(i + 1)},\n"
        f"     privateInterface: {interface}, pool: pool-h{i}, cluster: c1,\n"
        f"     accelerators: {{count: 8, backend: cuda, model: H100}}}}\n"
        for i in range(4)
    ] + [
        f"  - {{name: c-{i}, provider: vast, region: us-east-2, regionClass: us, "
        f"offering: container,\n"
        f"     address: {container.format(i + 1)}, nat: {str(netns).lower()}, pool: pool-c{i}, "
        f"cluster: c2,\n"
        f"     accelerators: {{count: 1, backend: cuda, model: L4}}}}\n"
        for i in range(3)
    ]
    if netns:
        direct = [("lambda", "us-west-1", "198.18.3.1", False)]
        direct += [("lambda", "us-west-1", "198.19.3.2", True)]
        direct += [("crusoe", "us-central-1", "198.18.6.1", False)]
        rows += [
            f"  - {{name: d-{i}, provider: {provider}, region: {region}, regionClass: us, "
            f"offering: vm,\n"
            f"     address: {address}, nat: {str(nat).lower()}, pool: pool-d{i}, cluster: c3,\n"
            f"     accelerators: {{count: 1, backend: cuda, model: A100}}}}\n"
            for i, (provider, region, address, nat) in enumerate(direct)
        ]
    return "machines:\n" + "".join(rows)


# The three paths' jobs, applied in turn: (accelerators, network, transport).
SHAPES = {
    "private": ("{count: 8, model: H100}", "Colocated", "Direct"),
    "relayed": ("{count: 1, model: L4}", "Regional", "Auto"),
    "direct": ("{count: 1, model: A100}", "Regional", "Direct"),
}


def path_of(index: int, netns: bool) -> str:
    """The path chaos-<index> is shaped for (SHAPES)."""
    paths = ["private", "relayed", "direct"] if netns else ["private", "relayed"]
    return paths[index % len(paths)]


# Every job applied is expected to end so; any other end is a violation naming it.
EXPECTED = Phase.SUCCEEDED
# The events a job that Succeeded published, in order (libs/jobs/lifecycle.py).
SUCCEEDED_EVENTS = ("admitted", "placed", "probing", "running", "succeeded")
# The repair in flight (a read-only root filesystem on h-3) must end so before the run ends.
REPAIR_NODE = "h-3"


def job(index: int, netns: bool) -> Job:
    accelerators, network, transport = SHAPES[path_of(index, netns)]
    return parse_job(
        f"""
apiVersion: nodus/v1
kind: Job
metadata: {{name: chaos-{index}, org: acme}}
spec:
  command: [python3, examples/workloads/allreduce.py]
  env: {{ALLREDUCE_MIB: "1", ALLREDUCE_ITERS: "6", ALLREDUCE_STEP_SECONDS: "0.5",
        ALLREDUCE_TIMEOUT_SECONDS: "60"}}
  image: {{libc: glibc}}
  accelerators: {accelerators}
  distributed: {{members: 2, network: {network}, transport: {transport}}}
""",
        f"chaos-{index}",
    )
