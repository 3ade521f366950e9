"""Draft-assist (LUMEN Algorithm 3): the wire protocol, the survivor's client and the
drafter's server, the sim engine's draft function and drafter process."""
