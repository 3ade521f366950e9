"""Draft-assist (LUMEN Algorithm 3): the wire protocol, the survivor's client, the drafter's server."""
