"""The Private path's member (G6): the provider's private network carries the gang; the agent
only opens the gang's ports to its members and closes them to everyone else (`member`, with
the port rules written through `services.agent.nft`)."""
