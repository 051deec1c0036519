"""Each Relayed and Direct epoch's dataplane in a process of its own (O4): the agent starts it,
watches it and re-adopts it when it starts again on the same boot, so an agent restart (an
upgrade, a crash) breaks no connection inside the tunnel.

- `store`: what the agent keeps of each joined epoch on the machine's disk;
- `control`: the unix-socket request/reply between the agent and a dataplane;
- `process`: the dataplane process (`python -m services.agent.dataplane`);
- `supervisor`: the agent's side: start, adopt, ask, stop, and the metrics collector;
- `inline`: the dataplane itself (RelayedMember or DirectMember) behind one face.
"""
